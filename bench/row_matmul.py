"""Decode products at small batch: a few rows times every layer's matrix, exact and quantized, XLA
against the row kernel.

    PYTHONPATH=. python3 bench/row_matmul.py [--models smollm2,llama-1b,qwen3-8b] [--rows 1,2,8] [--sweep qwen3-8b]

For each model's four layer matrices (wqkv, wo, w_gate_up, w_down) it times one scan over the layer
stack, as a decode step reads them, for: bf16 through XLA (decoder.matmul), bf16, int8 and group-wise
int4 through pallas_kernels.row_matmul (the stacked matrix read in place at the layer index), int8
through XLA (the matrix converted inside the product), and int4 through XLA (jnp.int4 values, dequantized before
the product). Each time is given per layer against its bytes floor (the matrix bytes over the copy
bandwidth measured in the same run). The kernel's output is checked against the reference first.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench import common
from jaxspec.models import decoder
from jaxspec.models.quantize import Quantized
import pallas_kernels as kernels

from pallas_kernels._common import interpret_default
from pallas_kernels.row_matmul import pack_int4, row_matmul_pallas, row_matmul_reference

MODELS = {"smollm2": common.SMOLLM2, "llama-1b": common.LLAMA_1B, "qwen3-8b": common.QWEN3_8B}
GROUP = 128


def matrices(cfg) -> dict[str, tuple[int, int]]:
    shapes = decoder.param_shapes(cfg)["layers"]
    return {name: shapes[name][1:] for name in decoder.MATRICES}


def make_weights(key, L: int, K: int, N: int) -> dict:
    """The same random matrix stack in every format."""
    k1, k2, k3 = jax.random.split(key, 3)
    groups = K // GROUP if K % GROUP == 0 else K // 64
    int4 = jax.random.randint(k1, (L, K, N), -8, 8, jnp.int8)
    return {
        "bf16": common.random_layers(k2, (L, K, N), jnp.bfloat16),
        "int8": Quantized(jax.random.randint(k3, (L, K, N), -127, 128, jnp.int8), jnp.full((L, N), 0.01, jnp.float32)),
        "int4_packed": jax.vmap(lambda v: pack_int4(v, groups))(int4),
        "int4_native": int4.astype(jnp.int4),
        "int4_scale": jnp.full((L, groups, N), 0.01, jnp.float32),
    }


def formats(w: dict) -> dict:
    """{kernel kind: (values, scale)} of make_weights' stacks (exact bf16: no scale)."""
    return {"bf16_pallas": (w["bf16"], None), "int8_pallas": (w["int8"].values, w["int8"].scale),
            "int4_pallas": (w["int4_packed"], w["int4_scale"])}


def scan_fn(kind: str, L: int, tiling: dict | None = None):
    """A jitted scan over the L layers' products of x with one matrix kind, as the model's layer scan
    runs them (XLA kinds: the stack is the scan's xs; Pallas kinds: the layer index is, the stack read
    in place); returns the summed outputs."""

    def xla_product(x, w):
        if kind in ("bf16", "int8_xla"):
            return decoder.matmul(x, w)
        v, s = w  # int4_xla
        K, N = v.shape
        dense = (v.astype(x.dtype).reshape(s.shape[0], -1, N) * s[:, None].astype(x.dtype)).reshape(K, N)
        return decoder.matmul(x, dense)

    @jax.jit
    def run(w, x):
        N = w["bf16"].shape[-1]
        if kind == "loop":  # the scan's own cost per layer: one tiny kernel per iteration
            product, xs = (lambda _: x[:, :1]), jnp.arange(L)
        elif kind.endswith("pallas"):
            values, scale = formats(w)[kind]
            product = lambda layer: row_matmul_pallas(x, values, scale, layer=layer, interpret=interpret_default(),
                                                      **(tiling or {}))
            xs = jnp.arange(L)
        else:
            xs = {"bf16": w["bf16"], "int8_xla": w["int8"], "int4_xla": (w["int4_native"], w["int4_scale"])}[kind]
            product = lambda layer_w: xla_product(x, layer_w)
        body = lambda acc, item: (acc + product(item).astype(jnp.float32), None)
        return jax.lax.scan(body, jnp.zeros((x.shape[0], N), jnp.float32), xs)[0]

    return run


def floor_bytes(kind: str, K: int, N: int) -> int:
    groups = K // GROUP if K % GROUP == 0 else K // 64
    return {"bf16": 2 * K * N, "bf16_pallas": 2 * K * N, "int8_xla": K * N + 4 * N, "int8_pallas": K * N + 4 * N,
            "int4_xla": K * N // 2 + 4 * groups * N, "int4_pallas": K * N // 2 + 4 * groups * N}[kind]


def check(w, M: int, key) -> float:
    """Largest |pallas - reference| over |reference| for layer 0, bf16, int8 and int4."""
    x = jax.random.normal(key, (M, w["bf16"].shape[1]), jnp.bfloat16)
    worst = 0.0
    for values, scale in formats(w).values():
        ref = row_matmul_reference(x.astype(jnp.float32), values[0], None if scale is None else scale[0])
        got = kernels.row_matmul(x, values, scale, jnp.float32, layer=jnp.int32(0), backend="pallas")
        worst = max(worst, float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))))
    return worst


TILINGS = [dict(block_n=bn, splits=sp, num_warps=w, num_stages=3)
           for bn in (128, 256) for sp in (1, 2, 4, 8, 16) for w in (4, 8)]
# More rows than one 64-row block (SmolLM2's batch-128 draft step): one block of all rows with
# narrower columns (the same accumulator size), against row blocks of 64 that each read the matrix.
ROW_TILINGS = [dict(block_m=bm, block_n=bn, splits=sp, num_warps=w, num_stages=3)
               for bm, bn in ((64, 128), (128, 64), (128, 32)) for sp in (None, 1, 3, 9) for w in (4, 8)]


def sweep(args, bw: float, save, result) -> list[dict]:
    """Per --sweep model, matrix and kind (exact, int8, int4): each tiling's time at --sweep-rows rows
    (TILINGS at one row, ROW_TILINGS at more than 64; tilings whose splits do not divide K's steps
    are left out, and splits None is the kernel's own rule)."""
    rows = result.setdefault("sweep", [])
    M = args.sweep_rows
    tilings = ROW_TILINGS if M > 64 else TILINGS
    for model in args.sweep.split(","):
        cfg = MODELS[model]
        for name, (K, N) in matrices(cfg).items():
            w = make_weights(jax.random.key(3), cfg.num_layers, K, N)
            x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
            for kind in ("bf16_pallas",) if M > 64 else ("bf16_pallas", "int8_pallas", "int4_pallas"):
                step = (GROUP if K % GROUP == 0 else 64) if kind == "int4_pallas" else 128 if K % 128 == 0 else 64
                for tiling in tilings:
                    if (tiling["splits"] and (K // step) % tiling["splits"]) or N % tiling["block_n"]:
                        continue
                    try:
                        t = common.seconds_per_call(scan_fn(kind, cfg.num_layers, tiling), w, x, min_run_s=0.02) / cfg.num_layers
                    except Exception as e:  # a tiling that does not compile (shared memory, registers)
                        print(f"{model} {name} {kind} {tiling}: {type(e).__name__}", flush=True)
                        continue
                    floor = floor_bytes(kind, K, N) / bw
                    rows.append({"model": model, "matrix": name, "kind": kind, "rows": M, **tiling,
                                 "us_per_layer": t * 1e6, "x_floor": t / floor})
                mine = [r for r in rows if (r["model"], r["matrix"], r["kind"]) == (model, name, kind)]
                for r in sorted(mine, key=lambda r: r["us_per_layer"])[:4]:
                    print(f"sweep {model} {name} {kind}: {r['us_per_layer']:.2f} us ({r['x_floor']:.2f}x floor) "
                          f"{ {k: r[k] for k in tilings[0]} }", flush=True)
                save()
            del w
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,llama-1b,qwen3-8b")
    p.add_argument("--rows", default="1,2,8")
    p.add_argument("--kinds", default="loop,bf16,bf16_pallas,int8_xla,int8_pallas,int4_xla,int4_pallas",
                   help="loop: the layer scan alone (its per-iteration cost is in every other kind's time)")
    p.add_argument("--sweep", default="", help="models whose matrices also sweep the kernel's tiling "
                                                "(block_n, splits, warps; block_m past 64 rows) at --sweep-rows rows")
    p.add_argument("--sweep-rows", type=int, default=1)
    p.add_argument("--out", default=str(common.RESULTS / "row_matmul.json"))
    args = p.parse_args()
    rates = common.measure_rates()
    bw = rates["copy_GBps"] * 1e9
    result = {**common.run_info(), "rates": rates, "rows": []}
    for model in args.models.split(","):
        cfg = MODELS[model]
        L = cfg.num_layers
        for name, (K, N) in matrices(cfg).items():
            w = make_weights(jax.random.key(hash(name) % 1000), L, K, N)
            for M in map(int, args.rows.split(",")):
                x = jax.random.normal(jax.random.key(M), (M, K), jnp.bfloat16)
                error = check(w, M, jax.random.key(7))
                for kind in args.kinds.split(","):
                    t = common.seconds_per_call(scan_fn(kind, L), w, x) / L
                    floor = None if kind == "loop" else floor_bytes(kind, K, N) / bw  # the loop reads no matrix
                    row = {"model": model, "matrix": name, "K": K, "N": N, "rows": M, "kind": kind,
                           "us_per_layer": t * 1e6, "floor_us": floor and floor * 1e6, "x_floor": floor and t / floor,
                           "pallas_rel_error": error}
                    result["rows"].append(row)
                    print(f"{model:9s} {name:10s} {K:6d}x{N:<6d} M={M} {kind:12s} {t * 1e6:8.2f} us"
                          + (f" floor {floor * 1e6:7.2f} ({t / floor:.2f}x)" if floor else ""), flush=True)
                del x
            del w
            common.write_json(common.Path(args.out), result)
    if args.sweep:
        result["sweep"] = sweep(args, bw, lambda: common.write_json(common.Path(args.out), result), result)
    print(common.markdown_table(result["rows"], [
        ("model", "model", "s"), ("matrix", "matrix", "s"), ("rows", "rows", "d"), ("kind", "kind", "s"),
        ("us/layer", "us_per_layer", ".2f"), ("floor us", "floor_us", ".2f"), ("x floor", "x_floor", ".2f")]))


if __name__ == "__main__":
    main()
