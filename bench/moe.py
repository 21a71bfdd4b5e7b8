"""One MoE layer's routed experts: the Pallas kernel against XLA's grouped product and the bytes floor.

    PYTHONPATH=. python3 bench/moe.py [--rows 1,8,32,128] [--out DIR] [--tiny]

At Qwen3-30B-A3B's expert shapes (bf16, D 2048, F 768, 128 experts, 8 routed a row) and T rows with
random routing, it times pallas_kernels.moe_experts on both backends: the kernel, and the reference
(lax.ragged_dot) as the decoder's layer scan would call it, at a traced layer of the stacks. The floor
is the routed experts' bytes: the distinct experts hit times one expert's bytes, over the copy bandwidth
measured in the same run. Each timed call is one of REPEATS in a scan, each with its own routing and
alternating between the two layers of the stacks, so no call finds its experts in L2. The kernel's
output is checked against the reference first. Writes DIR/moe.json (--tiny: moe_tiny.json, small
shapes on the CPU, the kernel in interpret mode: a smoke test of this script) and prints a table last.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import common
import pallas_kernels as kernels

QWEN3_30B_A3B = dict(D=common.QWEN3_30B_A3B.hidden_size, F=common.QWEN3_30B_A3B.moe.expert_size,
                     E=common.QWEN3_30B_A3B.moe.num_experts, k=common.QWEN3_30B_A3B.moe.top_k)
TINY = dict(D=64, F=32, E=8, k=2)
LAYERS = 2
REPEATS = 8


def routing(key, repeats: int, T: int, E: int, k: int):
    """(expert_ids [repeats, T, k] int32, k distinct random experts a row; router weights [repeats, T, k])."""
    k1, k2 = jax.random.split(key)
    ids = jnp.argsort(jax.random.uniform(k1, (repeats, T, E)), axis=-1)[..., :k].astype(jnp.int32)
    return ids, jax.nn.softmax(jax.random.normal(k2, (repeats, T, k)), axis=-1)


def layer_fn(backend: str):
    """A jitted scan of one MoE layer's experts per (layer, routing) item; returns the outputs' sum."""
    @jax.jit
    def run(x, ids, weights, w_gate_up, w_down):
        def body(total, item):
            layer, ids, weights = item
            out = kernels.moe_experts(x, ids, weights, w_gate_up, w_down, layer, backend=backend)
            return total + out.sum(), None

        layers = jnp.arange(ids.shape[0], dtype=jnp.int32) % LAYERS
        return lax.scan(body, jnp.float32(0), (layers, ids, weights))[0]

    return run


def time_rows(T: int, shape: dict, repeats: int, stacks, bw: float) -> dict:
    D, F, E, k = shape["D"], shape["F"], shape["E"], shape["k"]
    x = jax.random.normal(jax.random.key(T), (T, D), jnp.bfloat16)
    ids, weights = routing(jax.random.key(1000 + T), repeats, T, E, k)
    layer = jnp.int32(1)
    want, got = (kernels.moe_experts(x, ids[0], weights[0], *stacks, layer, backend=b) for b in kernels.BACKENDS)
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    distinct = float(np.mean([len(np.unique(np.asarray(i))) for i in ids]))
    floor_us = distinct * 3 * D * F * 2 / (bw * 1e9) * 1e6
    row = {"rows": T, "distinct_experts": distinct, "floor_us": floor_us, "max_rel_err": err}
    for backend in kernels.BACKENDS:
        us = common.seconds_per_call(layer_fn(backend), x, ids, weights, *stacks) / repeats * 1e6
        row |= {f"{backend}_us": us, f"{backend}_over_floor": us / floor_us}
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,128", help="token rows T, comma-separated")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU: a smoke test of this script")
    args = p.parse_args()
    shape, repeats = (TINY, 2) if args.tiny else (QWEN3_30B_A3B, REPEATS)
    rows = [1, 8] if args.tiny else [int(r) for r in args.rows.split(",")]
    result = common.run_info() | {"shape": shape, "layers": LAYERS, "repeats": repeats,
                                  "rates": common.measure_rates(args.tiny), "rows": []}
    D, F, E = shape["D"], shape["F"], shape["E"]
    stacks = (common.random_layers(jax.random.key(0), (LAYERS, E, D, 2 * F), jnp.bfloat16),
              common.random_layers(jax.random.key(1), (LAYERS, E, F, D), jnp.bfloat16))
    path = args.out / ("moe_tiny.json" if args.tiny else "moe.json")
    for T in rows:
        result["rows"].append(time_rows(T, shape, repeats, stacks, result["rates"]["copy_GBps"]))
        print(result["rows"][-1], flush=True)
        common.write_json(path, result)
    print(common.markdown_table(result["rows"], [
        ("T", "rows", "d"), ("experts hit", "distinct_experts", ".1f"), ("floor µs", "floor_us", ".1f"),
        ("kernel µs", "pallas_us", ".1f"), ("kernel / floor", "pallas_over_floor", ".2f"),
        ("XLA µs", "reference_us", ".1f"), ("XLA / floor", "reference_over_floor", ".2f"),
        ("max rel err", "max_rel_err", ".1e")]))


if __name__ == "__main__":
    main()
