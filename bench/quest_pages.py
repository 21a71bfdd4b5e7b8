"""Quest's page choice: the fused Pallas kernel against XLA (einsum scores + lax.top_k), per layer.

    PYTHONPATH=. python3 bench/quest_pages.py [--out DIR] [--tiny]

Why: the fused kernel runs one program per (row, KV head), so it wins when those fill the GPU and
loses when a few programs must each stream a long row of bounds (Qwen3-8B at batch 1: 8 programs
over 2,048 pages). This times both as the draft runs them: one call per layer in a scan over 8
layers of bf16 page bounds (k = 7% of the pages, every page a candidate), at SmolLM2 and Qwen3-8B
shapes over batch sizes, and gives the bytes floor (both bounds read once). Writes
DIR/quest_pages.json and prints a table last; `kernels.QUEST_FUSED_MIN_PROGRAMS` follows from it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from bench import common
from pallas_kernels._common import interpret_default
from pallas_kernels import paging
from pallas_kernels.quest_pages import QUEST_PAGE, quest_pages_pallas, quest_pages_reference

LAYERS = 8
PAGE_SIZE = paging.DEFAULT_PAGE_SIZE  # the cache's: its pages hold PAGE_SIZE / 16 bounds each
SHAPES = {  # name: (Hq, Hkv, pages, Dh), batch sizes
    "smollm2_7.9k": ((9, 3, 496, 64), (1, 8, 16, 32, 64, 128)),
    "qwen3_8b_32k": ((32, 8, 2048, 128), (1, 4, 8, 16, 32)),
}  # pages: whole cache pages of PAGE_SIZE / 16
TINY = {"tiny": ((4, 2, 64, 16), (1, 2))}


def time_shape(Hq, H, P, Dh, B, rate_GBps):
    keys = jax.random.split(jax.random.key(B), 3)
    per_page = PAGE_SIZE // QUEST_PAGE  # bounds a cache page
    q = jax.random.normal(keys[0], (LAYERS, B, 1, Hq, Dh), jnp.bfloat16)
    lo = jax.random.normal(keys[1], (LAYERS, H, B * P + per_page, Dh), jnp.bfloat16)  # rows' pages and the null page
    hi = lo + jnp.abs(jax.random.normal(keys[2], lo.shape, jnp.bfloat16))
    pages = paging.contiguous_pages(B, P // per_page)
    last, k = jnp.full((B,), P, jnp.int32), jnp.full((B,), max(1, P * 7 // 100), jnp.int32)
    k_max = int(k[0])
    row = {"batch": B, "programs": B * H}
    for name, f in (("xla", quest_pages_reference),
                    ("fused", lambda *a, **kw: quest_pages_pallas(*a, **kw, interpret=interpret_default()))):
        def run(q, lo, hi, f=f):
            def body(total, layer):
                return total + f(q[layer], lo, hi, pages, layer, last, k, k_max, page_size=PAGE_SIZE).sum(), None
            return lax.scan(body, jnp.int32(0), jnp.arange(LAYERS))[0]
        row[f"{name}_us"] = common.seconds_per_call(jax.jit(run), q, lo, hi) / LAYERS * 1e6
    row["floor_us"] = 2 * B * H * P * Dh * 2 / (rate_GBps * 1e3)
    row["fused_over_xla"] = row["fused_us"] / row["xla_us"]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    args = p.parse_args()
    result = common.run_info() | {"rates": common.measure_rates(args.tiny), "rows": []}
    for name, (shape, batches) in (TINY if args.tiny else SHAPES).items():
        for B in batches:
            result["rows"].append({"shape": name, **time_shape(*shape, B, result["rates"]["copy_GBps"])})
            print(result["rows"][-1], flush=True)
            common.write_json(args.out / "quest_pages.json", result)
    print(common.markdown_table(result["rows"], [
        ("shape", "shape", "s"), ("batch", "batch", "d"), ("programs", "programs", "d"), ("XLA us", "xla_us", ".1f"),
        ("fused us", "fused_us", ".1f"), ("floor us", "floor_us", ".1f"), ("fused / XLA", "fused_over_xla", ".2f")]))


if __name__ == "__main__":
    main()
