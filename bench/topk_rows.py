"""select_topk's radix kernel against lax.top_k by row length: where the switch should send a row.

    PYTHONPATH=. python3 bench/topk_rows.py [--out DIR] [--tiny]

Why: the radix select runs ~10 passes of a few launches each, which pays on vegas's long rows
([L, B, S] slots: 3-4x faster than lax.top_k at 8K-128K, bench/NOTES.md) but is a fixed ~60 us on
short ones, and quest selects pages, rows of S/16, once per layer and draft step. This times both
on float32 scores [rows, S], k = 7% of S, for row lengths 256-32K and 8 or 384 rows (Qwen3-8B's KV
heads at batch 1; SmolLM2's 3 heads at batch 128), and writes DIR/topk_rows.json; a table last.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from pallas_kernels._common import interpret_default
from pallas_kernels.topk import select_topk_pallas, select_topk_reference

RATIO = 0.07
LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 32768)
ROWS = (8, 384)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    args = p.parse_args()
    result = common.run_info() | {"rows": []}
    for rows in (2,) if args.tiny else ROWS:
        for S in (256,) if args.tiny else LENGTHS:
            k = math.ceil(RATIO * S)
            scores = jax.random.normal(jax.random.key(S + rows), (rows, S), jnp.float32)
            count = jnp.full((rows,), k, jnp.int32)
            radix = jax.jit(lambda s: select_topk_pallas(s, k, count, interpret=interpret_default()))
            top_k = jax.jit(lambda s: select_topk_reference(s, k, count))
            row = {"rows": rows, "S": S, "k": k, "radix_us": common.seconds_per_call(radix, scores) * 1e6,
                   "top_k_us": common.seconds_per_call(top_k, scores) * 1e6}
            result["rows"].append(row)
            print(row, flush=True)
            common.write_json(args.out / "topk_rows.json", result)
    print(common.markdown_table(result["rows"], [("rows", "rows", "d"), ("S", "S", "d"), ("k", "k", "d"),
                                                 ("radix us", "radix_us", ".1f"), ("lax.top_k us", "top_k_us", ".1f")]))


if __name__ == "__main__":
    main()
