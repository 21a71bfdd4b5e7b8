"""The attention kernels' split-K count against its rule (`_common.num_splits`), per shape.

    PYTHONPATH=. python3 bench/splits.py [--kernels sparse,verify] [--shapes NAME,...] [--splits 1,2,...] [--ratio 0.07] [--balance 1,2] [--pages scattered|contiguous] [--out DIR] [--tiny]

Why: the rule aimed at about 256 (batch x KV head x split) programs with at most 16 splits. With few
KV heads at batch 1 (a 1.2B Llama's 2, SmolLM2's 3) that cap left 32-48 programs streaming the
whole cache; this sweep showed such grids want one wave of ~128 programs (the rule since). And at SmolLM2 128 x
7.5K the draft step's sparse attention moves its 7% selection at about half the copy bandwidth.
Each kernel is timed one call per layer in a scan over 8 cache layers, as the model runs it (the
split merge included, every output element kept), for split counts 1-128 and the rule's choice,
against the bytes it reads: the sparse kernel's gathered K and V (7% of the slots and a 16-token
tail), the verify kernel's whole cache up to the query. `--balance B` gives the sparse kernel's rows
the budgets a shared budget (`SpecConfig.balance`) gives them: shares log-uniform over [1/B, B],
scaled to mean 1 (the same total), and the rule its split count for that skew.
Random bf16 paged pools (pages of 128 slots; --pages: rows' pages in random order over the pool, as a
server's, or consecutive); writes DIR/splits.json and prints a table last.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import common
from pallas_kernels import paging
from pallas_kernels._common import interpret_default, num_splits, row_blocks
from pallas_kernels.sparse_attention import BLOCK_K as SPARSE_BLOCK_K
from pallas_kernels.sparse_attention import sparse_attention_pallas
from pallas_kernels.verify_attention import BLOCK_K as VERIFY_BLOCK_K
from pallas_kernels.verify_attention import verify_attention_pallas

RATIO, TAIL, LAYERS = 0.07, 16, 8
PAGE = paging.DEFAULT_PAGE_SIZE
SPLITS = (1, 2, 3, 4, 6, 8, 16, 32, 64, 128)
SHAPES = {  # kernel: {name: (B, S, Hq, Hkv, Dh, T)}; T is the query rows (the sparse kernel's is 1)
    "sparse": {
        "smollm2_b128": (128, 7936, 9, 3, 64, 1),
        "smollm2_b32": (32, 7936, 9, 3, 64, 1),
        "smollm2_b8": (8, 7936, 9, 3, 64, 1),
        "smollm2_b1": (1, 7936, 9, 3, 64, 1),
        "qwen3_b1_32k": (1, 32768, 32, 8, 128, 1),
        "qwen3_b4_32k": (4, 32768, 32, 8, 128, 1),
    },
    "verify": {
        "llama1b_b1_16k_t1": (1, 16384, 32, 2, 64, 1),
        "llama1b_b1_16k_t7": (1, 16384, 32, 2, 64, 7),
        "smollm2_b1_t1": (1, 7936, 9, 3, 64, 1),
        "smollm2_b1_t7": (1, 7936, 9, 3, 64, 7),
        "qwen3_b1_32k_t1": (1, 32768, 32, 8, 128, 1),
        "qwen3_b1_32k_t7": (1, 32768, 32, 8, 128, 7),
        "qwen3_b2_32k_t7": (2, 32768, 32, 8, 128, 7),
        "llama1b_b4_16k_t1": (4, 16384, 32, 2, 64, 1),
        "smollm2_b8_t7": (8, 7936, 9, 3, 64, 7),
        "smollm2_b32_t7": (32, 7936, 9, 3, 64, 7),
        "qwen3_b4_32k_t1": (4, 32768, 32, 8, 128, 1),
        "qwen3_b4_32k_t7": (4, 32768, 32, 8, 128, 7),
        "qwen3_b16_8k_t7": (16, 8192, 32, 8, 128, 7),
    },
}
TINY = {"sparse": {"tiny": (2, 512, 4, 2, 16, 1)}, "verify": {"tiny": (1, 512, 4, 2, 16, 3)}}


def sparse_case(B, S, Hq, Hkv, Dh, T, layers, ratio=RATIO, balance=1.0):
    """(call(q, k, v, pages, layer, splits), q, programs without splits, key blocks, bytes read);
    `ratio` of the slots gathered on average, a row's share of that within [1/balance, balance]."""
    K = math.ceil(ratio * S)
    rng = np.random.default_rng(0)
    share = np.exp(rng.uniform(-math.log(balance), math.log(balance), B))
    n_idx = np.clip(np.round(share / share.mean() * K), 1, math.ceil(balance * K)).astype(np.int32)
    k_max = int(n_idx.max())
    idx = np.stack([[rng.permutation(S - TAIL)[:k_max]] for _ in range(B)])[None]  # [1, B, 1, K]: one list per row
    idx = jnp.broadcast_to(jnp.asarray(idx, jnp.int32), (layers, B, 1, k_max))
    q = jax.random.normal(jax.random.key(1), (layers, B, T, Hq, Dh), jnp.bfloat16)
    n_idx, tail = jnp.asarray(n_idx), jnp.full((B,), S - TAIL, jnp.int32)
    pos = jnp.full((B, 1), S - 1, jnp.int32)

    def call(q, k, v, pages, layer, splits):
        return sparse_attention_pallas(q, k, v, pages, layer, idx, n_idx, tail, pos, page_size=PAGE, scale=Dh ** -0.5,
                                       tail_capacity=TAIL, n_splits=splits, interpret=interpret_default())

    blocks = math.ceil(k_max / SPARSE_BLOCK_K) + math.ceil(TAIL / SPARSE_BLOCK_K)
    read = (int(n_idx.sum()) + B * TAIL) * Hkv * Dh * 2 * 2
    return call, q, B * Hkv * row_blocks(T, Hq // Hkv)[0], blocks, read


def verify_case(B, S, Hq, Hkv, Dh, T, layers):
    """As sparse_case, for the verify kernel: T rows ending at the cache's last slot."""
    q = jax.random.normal(jax.random.key(1), (layers, B, T, Hq, Dh), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T))

    def call(q, k, v, pages, layer, splits):
        return verify_attention_pallas(q, k, v, pages, layer, pos, page_size=PAGE, scale=Dh ** -0.5,
                                       n_splits=splits, interpret=interpret_default())[0]

    return call, q, B * Hkv * row_blocks(T, Hq // Hkv)[0], S // VERIFY_BLOCK_K, B * Hkv * S * Dh * 2 * 2


def time_shape(kernel, B, S, Hq, Hkv, Dh, T, layers, counts=SPLITS, ratio=RATIO, balance=1.0, scattered=True):
    """Rows {splits, default, us, GBps} for the rule's split count and every one of `counts` that
    fits the kernel's key blocks."""
    shape = (B, S, Hq, Hkv, Dh, T, layers)
    call, q, programs, blocks, read = (sparse_case(*shape, ratio, balance) if kernel == "sparse"
                                       else verify_case(*shape))
    keys = jax.random.split(jax.random.key(0), 2)
    pool = (layers, Hkv, B * S + PAGE, Dh)  # the rows' pages and the null page
    k, v = (jax.random.normal(key, pool, jnp.bfloat16) for key in keys)
    pages = common.page_table(B, S, PAGE, scattered)
    default = num_splits(programs, blocks, balance if B > 1 else 1.0)  # as sparse_attention_pallas counts it
    rows = []
    for splits in sorted({s for s in counts if s <= blocks} | {default}):
        def run(q, k, v, splits=splits):
            def body(total, layer):
                o = call(q[layer], k, v, pages, layer, splits)
                return total + o.astype(jnp.float32).sum(), None  # all of o: the merge is not pruned
            return lax.scan(body, jnp.float32(0), jnp.arange(layers))[0]

        us = common.seconds_per_call(jax.jit(run), q, k, v) / layers * 1e6
        rows.append({"splits": splits, "programs": programs * splits, "default": "yes" if splits == default else "",
                     "us": us, "GBps": read / us / 1e3})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="sparse,verify", help="comma-separated: sparse, verify")
    p.add_argument("--shapes", default="", help="comma-separated shape names (default: every one of the kernels')")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--splits", default=",".join(map(str, SPLITS)), type=lambda s: [int(n) for n in s.split(",") if n],
                   help="comma-separated split counts besides the rule's ('' for the rule's alone)")
    p.add_argument("--ratio", type=float, default=RATIO, help="the sparse kernel's share of the slots gathered")
    p.add_argument("--balance", default="1", type=lambda s: [float(b) for b in s.split(",")],
                   help="comma-separated: the sparse kernel's rows' budgets within [1/B, B] of the mean")
    p.add_argument("--pages", choices=("scattered", "contiguous"), default="scattered",
                   help="rows' pages in random order over the pool (a server's) or consecutive")
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    args = p.parse_args()
    kernels = args.kernels.split(",")
    if min(args.balance) < 1:
        p.error("--balance: each value must be at least 1")
    if not set(kernels) <= set(SHAPES):
        p.error(f"--kernels: choose from {', '.join(SHAPES)}")
    result = common.run_info() | {"rates": common.measure_rates(args.tiny), "rows": []}
    for kernel in kernels:
        for name, shape in (TINY if args.tiny else SHAPES)[kernel].items():
            if args.shapes and name not in args.shapes.split(","):
                continue
            for balance in args.balance if kernel == "sparse" else [1.0]:
                for row in time_shape(kernel, *shape, layers=2 if args.tiny else LAYERS, counts=args.splits,
                                      ratio=args.ratio, balance=balance, scattered=args.pages == "scattered"):
                    result["rows"].append({"kernel": kernel, "shape": name, "ratio": args.ratio if kernel == "sparse" else None,
                                           "balance": balance, **row})
                    print(result["rows"][-1], flush=True)
                common.write_json(args.out / "splits.json", result)
    print(common.markdown_table(result["rows"], [
        ("kernel", "kernel", "s"), ("shape", "shape", "s"), ("balance", "balance", "g"), ("splits", "splits", "d"),
        ("programs", "programs", "d"), ("rule's", "default", "s"),
        ("us per call", "us", ".1f"), ("GB/s read", "GBps", ".0f")]))


if __name__ == "__main__":
    main()
