"""How fast a Pallas-Triton program gathers rows of the KV cache: time against rows, row bytes and programs.

    PYTHONPATH=. python3 bench/gather_rate.py [--out DIR] [--tiny]

Why: the sparse draft kernel at SmolLM2 128 x 7.9K (384 programs, ~570 keys each, 64-element bf16 K
and V rows) takes the same time with 8-bit K/V, with K and V packed in one row, with twice the
programs and with half the loop steps (bench/NOTES.md, issue 13). If each SM can keep only so many
row requests in flight, the time follows the rows gathered, not their bytes, and that rate is the
kernel's floor, not the copy bandwidth. This measures it with nothing but the gather: each program
loads its rows `block` at a time (the sparse kernel's loop: a block of row numbers, then those rows),
adds them into a float32 tile, and stores its column sums. Rows are drawn at random (distinct, unsorted)
within the program's own region of 7,936 rows, as one (row, KV head)'s cache is, or read contiguously;
and random rows whose numbers are loaded a step ahead of the rows (a loop-carried slot list).
The sparse kernel itself is timed at the same shape in the same run (bench/splits.py's case) at
three budgets: at 0.07 its K and V rows are about TOTAL_ROWS.
Writes DIR/gather_rate.json and prints a table last.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench import common, splits
from pallas_kernels._common import interpret_default

REGION = 7936  # rows a program draws from (one sequence's cache for one KV head)
REGIONS = 768  # 128 sequences x 3 KV heads x (K, V): one SmolLM2 layer's cache at 128 x 7.9K
TOTAL_ROWS = 768 * 576  # the sparse kernel's K and V rows at ratio 0.07 with its tail, in 64-row blocks
BLOCK = 64
REPEATS = 16


def _kernel(region_ref, idx_ref, x_ref, o_ref, *, steps, block, contiguous, ahead):
    p = pl.program_id(0)
    region = region_ref[p]
    acc = jnp.zeros((block, x_ref.shape[2]), jnp.float32)

    if ahead:  # each step loads the next block's row numbers and gathers the rows loaded the step before
        def body_ahead(i, carry):
            acc, rows = carry
            following = idx_ref[p, pl.ds(jnp.minimum(i + 1, steps - 1) * block, block)]
            return acc + x_ref[region, rows, :].astype(jnp.float32), following

        acc, _ = lax.fori_loop(0, steps, body_ahead, (acc, idx_ref[p, pl.ds(0, block)]))
    else:
        def body(i, acc):
            if contiguous:
                rows = idx_ref[p, 0] + i * block + jnp.arange(block)
            else:
                rows = idx_ref[p, pl.ds(i * block, block)]
            return acc + x_ref[region, rows, :].astype(jnp.float32)

        acc = lax.fori_loop(0, steps, body, acc)
    o_ref[p, :] = acc.sum(axis=0)


def gather_sums(idx, x, shift, *, contiguous: bool, ahead: bool = False, block: int = BLOCK, num_stages: int = 3,
                num_warps: int = 4):
    """Program p adds up rows idx[p] of x[(p + shift) % regions] (contiguous: idx[p, 0] onwards); [P, W] float32.
    ahead: row numbers loaded a step ahead of their rows (random rows only)."""
    P, n = idx.shape
    kernel = functools.partial(_kernel, steps=n // block, block=block, contiguous=contiguous, ahead=ahead)
    return pl.pallas_call(
        kernel, grid=(P,), in_specs=[pl.no_block_spec] * 3, out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((P, x.shape[2]), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret_default(), name="gather_rate",
    )((jnp.arange(P, dtype=jnp.int32) + shift) % x.shape[0], idx, x)


def row_numbers(P: int, n: int, region: int, contiguous: bool, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if contiguous:
        return np.repeat(rng.integers(0, region - n + 1, (P, 1)), n, axis=1).astype(np.int32)
    return np.stack([rng.permutation(region)[:n] for _ in range(P)]).astype(np.int32)


def time_case(x, P: int, total: int, contiguous: bool, num_stages: int, check: bool, ahead: bool = False) -> dict:
    """One call's time, from REPEATS calls in a scan (a call a dispatch would time the host)."""
    n = total // P
    if n % BLOCK:
        raise ValueError(f"{n} rows a program: not a multiple of {BLOCK}")
    idx = jnp.asarray(row_numbers(P, n, x.shape[1], contiguous))
    call = functools.partial(gather_sums, contiguous=contiguous, ahead=ahead, num_stages=num_stages)
    if check:  # the reference: the same rows, summed by XLA
        rows = idx[:, :1] + jnp.arange(n) if contiguous else idx
        want = x[(jnp.arange(P)[:, None] + 1) % x.shape[0], rows].astype(jnp.float32).sum(axis=1)
        np.testing.assert_allclose(np.asarray(jax.jit(call)(idx, x, 1)), np.asarray(want), rtol=1e-4, atol=1e-3)

    def run(idx, x):  # every call reads other regions (the shift), so none is hoisted out of the loop
        return lax.scan(lambda total, i: (total + call(idx, x, i).sum(), None), jnp.float32(0),
                        jnp.arange(REPEATS))[0]

    us = common.seconds_per_call(jax.jit(run), idx, x) / REPEATS * 1e6
    row_bytes = x.shape[2] * x.dtype.itemsize
    mode = "contiguous" if contiguous else "random, rows a step ahead" if ahead else "random"
    return {"programs": P, "rows_per_program": n, "row_bytes": row_bytes, "mode": mode,
            "stages": num_stages, "us": us, "Grows_per_s": total / us / 1e3, "GBps": total * row_bytes / us / 1e3}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    args = p.parse_args()
    result = common.run_info() | {"rates": common.measure_rates(args.tiny), "rows": []}
    regions, region, total = (4, 512, 8 * 128) if args.tiny else (REGIONS, REGION, TOTAL_ROWS)
    result["sms"] = getattr(jax.devices()[0], "core_count", None)
    program_counts = (4, 8) if args.tiny else (384, 2304)
    for width in ((16, 64) if args.tiny else (16, 32, 64, 128, 256)):  # row bytes 32 .. 512
        x = jax.random.normal(jax.random.key(width), (regions, region, width), jnp.bfloat16)
        cases = [(P, total, contiguous, 3, False) for contiguous in (False, True) for P in program_counts]
        if width == 64:  # the cache's rows: no pipelining, row numbers a step ahead, other row counts (the slope)
            cases += [(P, total, False, 1, False) for P in program_counts]
            cases += [(P, total, False, stages, True) for P in program_counts for stages in (3, 2)]
            cases += [(program_counts[0], program_counts[0] * n, False, 3, False) for n in (3 * BLOCK, 9 * BLOCK, 36 * BLOCK)]
        for P, rows, contiguous, stages, ahead in cases:
            row = time_case(x, P, rows, contiguous, stages, check=P == program_counts[0], ahead=ahead)
            result["rows"].append({"kernel": "gather", **row})
            print(row, flush=True)
            common.write_json(args.out / "gather_rate.json", result)
        del x
    # The sparse kernel at the shape it is measured at (its K and V rows are TOTAL_ROWS, 128 bytes each)
    shape = (2, 512, 4, 2, 16, 1) if args.tiny else splits.SHAPES["sparse"]["smollm2_b128"]
    for ratio in (0.002, 0.035, splits.RATIO):
        for row in splits.time_shape("sparse", *shape, layers=2 if args.tiny else splits.LAYERS, counts=(), ratio=ratio):
            result["rows"].append({"kernel": f"sparse_attention {ratio}", "programs": row["programs"], "row_bytes": shape[4] * 2,
                                   "mode": "random", "stages": 3, "us": row["us"], "GBps": row["GBps"],
                                   "Grows_per_s": row["GBps"] / (shape[4] * 2)})
            print(result["rows"][-1], flush=True)
    common.write_json(args.out / "gather_rate.json", result)
    print(f"SMs: {result['sms']}")
    print(common.markdown_table(result["rows"], [
        ("kernel", "kernel", "s"), ("mode", "mode", "s"), ("row bytes", "row_bytes", "d"), ("programs", "programs", "d"), ("rows a program", "rows_per_program", "d"),
        ("stages", "stages", "d"), ("us", "us", ".1f"), ("G rows/s", "Grows_per_s", ".2f"), ("GB/s", "GBps", ".0f")]))


if __name__ == "__main__":
    main()
