"""The verify kernel on draft-tree rows: time per layer against the KV bytes floor, at SmolLM2's
attention shapes (9 query / 3 KV heads, Dh 64) and a 7K context, for trees of 16, 31 and 64 rows.

    PYTHONPATH=. python3 bench/tree_verify_kernel.py [--batches 1,8,32] [--baseline FILE] [--pages scattered|contiguous] [--tiny] [--out DIR]

--baseline FILE: another verify_attention.py (an earlier version of the kernel, on paged pools) timed in
the same run on the same inputs, its output checked against this one's. The cache is a pool of 128-slot
pages; --pages: rows' pages in random order over it (a server's, the default) or consecutive.
Writes DIR/tree_verify_kernel_<device>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec.decoding.tree import TreeShape
from pallas_kernels import paging
from pallas_kernels._common import interpret_default

SHAPES = ["3,2,1", "3,3,1,1", "7,1,1,1,1,1,1,1,1"]  # 16, 31, 64 rows
HQ, HKV, DH, CONTEXT = 9, 3, 64, 7168
PAGE = paging.DEFAULT_PAGE_SIZE


def load(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_verify", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--baseline", type=Path, default=None)
    p.add_argument("--pages", choices=("scattered", "contiguous"), default="scattered")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    context = 512 if args.tiny else CONTEXT
    rates = common.measure_rates(args.tiny)
    current = importlib.import_module("pallas_kernels.verify_attention")
    impls = {"current": current} | ({"baseline": load(args.baseline)} if args.baseline else {})
    result = common.run_info() | {"rates": rates, "rows": []}
    for B in map(int, args.batches.split(",")):
        key = jax.random.key(B)
        S = context + 128
        k, v = (jax.random.normal(kk, (1, HKV, B * S + PAGE, DH), jnp.bfloat16) for kk in jax.random.split(key, 2))
        pages = common.page_table(B, S, PAGE, args.pages == "scattered")
        for text in SHAPES:
            tree = TreeShape.parse(text)
            T = tree.rows
            q = jax.random.normal(jax.random.fold_in(key, T), (B, T, HQ, DH), jnp.bfloat16)
            first = jnp.full((B,), context - 1, jnp.int32)
            q_pos = first[:, None] + jnp.arange(T, dtype=jnp.int32)
            row = {"batch": B, "tree": text, "rows": T,
                   "floor_us": 2 * B * HKV * (context + T) * DH * 2 / (rates["copy_GBps"] * 1e3)}
            outs = {}
            for name, module in impls.items():
                fn = jax.jit(lambda q, k, v, module=module: module.verify_attention_pallas(
                    q, k, v, pages, 0, q_pos, page_size=PAGE, scale=DH**-0.5,
                    tree=module.TreeMask(first, tree.ancestors), interpret=interpret_default())[0])
                outs[name] = fn(q, k, v)
                row[f"{name}_us"] = common.seconds_per_call(fn, q, k, v) * 1e6
                row[f"{name}_x_floor"] = row[f"{name}_us"] / row["floor_us"]
            if "baseline" in outs:
                diff = np.abs(np.asarray(outs["current"], np.float32) - np.asarray(outs["baseline"], np.float32)).max()
                row["max_abs_diff"] = float(diff)
            result["rows"].append(row)
            print(row, flush=True)
    device = "cpu" if args.tiny else jax.devices()[0].device_kind.split()[1].lower()
    common.write_json(args.out / f"tree_verify_kernel_{device}.json", result)
    columns = [("B", "batch", "d"), ("tree", "tree", "s"), ("rows", "rows", "d"), ("floor us", "floor_us", ".1f"),
               ("us", "current_us", ".1f"), ("x floor", "current_x_floor", ".2f")]
    if args.baseline:
        columns += [("baseline us", "baseline_us", ".1f"), ("baseline x floor", "baseline_x_floor", ".2f"),
                    ("max |diff|", "max_abs_diff", ".2g")]
    print(common.markdown_table(result["rows"], columns))


if __name__ == "__main__":
    main()
