"""Which formulation of a decode step's weight reads runs at bandwidth (Qwen3-8B shapes, bf16).

    PYTHONPATH=. python3 bench/projections.py [--rows 1,5,8] [--tiny] [--out DIR]

A decode step multiplies a few rows (batch x query rows) by every weight matrix once, so each
product should read its weights at copy bandwidth. Variants, each timed as one jitted call:
- LM head [rows, D] x [D, V]: float32 output (preferred_element_type), bf16 output then cast, and
  float32 output with one row padded to two;
- q/k/v: three products per layer against one product with the fused [D, (Hq + 2 Hkv) Dh] matrix;
- gate/up: two products per layer against one with the fused [D, 2F] matrix;
the per-layer ones in a `lax.scan` over stacked [L, ...] weights, as the model runs them. Writes
DIR/projections.json; prints a table (microseconds, GB/s of weight bytes) last.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common


def lm_head_variants():
    def f32_out(h, w):
        return jnp.dot(h, w, preferred_element_type=jnp.float32)

    def bf16_out(h, w):
        return jnp.dot(h, w).astype(jnp.float32)

    def padded(h, w):
        if h.shape[0] > 1:
            return f32_out(h, w)
        return f32_out(jnp.concatenate([h, h]), w)[:1]

    return {"lm_head f32 out": f32_out, "lm_head bf16 out": bf16_out, "lm_head f32 out, 1 row padded to 2": padded}


def scanned(products):
    """A scan over stacked layers applying `products(h, layer_weights)`; the rows carry a dependence."""

    def run(h, weights):
        def layer(h, w):
            outs = products(h, w)
            return h + sum(o[:, :1].astype(h.dtype) for o in outs), None

        return jax.lax.scan(layer, h, weights)[0]

    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,5,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU smoke test of this script")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    cfg = common.QWEN3_8B
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if args.tiny:
        L, D, F, V, q, kv = 2, 256, 512, 1024, 256, 64
    rates = common.measure_rates(args.tiny)
    keys = iter(jax.random.split(jax.random.key(0), 16))
    rand = lambda *shape: jax.random.normal(next(keys), shape, jnp.bfloat16) * 0.02
    head = rand(D, V)
    wq, wk, wv = rand(L, D, q), rand(L, D, kv), rand(L, D, kv)
    wqkv = jnp.concatenate([wq, wk, wv], axis=-1)
    wg, wu = rand(L, D, F), rand(L, D, F)
    wgu = jnp.concatenate([wg, wu], axis=-1)
    cases = {name: (fn, head) for name, fn in lm_head_variants().items()}
    cases |= {
        "q, k, v separate": (scanned(lambda h, w: [jnp.dot(h, w[0]), jnp.dot(h, w[1]), jnp.dot(h, w[2])]), (wq, wk, wv)),
        "qkv fused": (scanned(lambda h, w: [jnp.dot(h, w)]), wqkv),
        "gate, up separate": (scanned(lambda h, w: [jnp.dot(h, w[0]), jnp.dot(h, w[1])]), (wg, wu)),
        "gate_up fused": (scanned(lambda h, w: [jnp.dot(h, w)]), wgu),
    }
    result = common.run_info() | {"rates": rates, "rows": []}
    for rows in args.rows:
        h = rand(rows, D) * 50
        for name, (fn, weights) in cases.items():
            seconds = common.seconds_per_call(jax.jit(fn), h, weights)
            nbytes = common.tree_bytes(weights)
            row = {"variant": name, "rows": rows, "us": seconds * 1e6, "GBps": nbytes / seconds / 1e9,
                   "floor_us": nbytes / (rates["copy_GBps"] * 1e9) * 1e6}
            print(row, flush=True)
            result["rows"].append(row)
    common.write_json(args.out / "projections.json", result)
    print(common.markdown_table(result["rows"], [("variant", "variant", "s"), ("rows", "rows", "d"), ("us", "us", ".1f"),
                                                 ("floor us", "floor_us", ".1f"), ("GB/s", "GBps", ".0f")]))


if __name__ == "__main__":
    main()
