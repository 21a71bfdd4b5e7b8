"""The draft step's sparse attention against its split count, at SmolLM2 and Qwen3-8B shapes.

    PYTHONPATH=. python3 bench/sparse_splits.py [--out DIR] [--tiny]

Why: at SmolLM2 128 x 7.5K the kernel moves its 7% selection at about half the copy bandwidth, and
the split rule (`_common.num_splits`: about 256 programs) gives that shape one split. This times one
call per layer in a scan over 8 cache layers, as the model runs it (the split merge included, every
output element kept), for split counts 1-16 and the rule's choice, against the gathered bytes
(7% of the slots and a 16-token tail, K and V). Random bf16 caches; writes DIR/sparse_splits.json
and prints a table last.
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
from pallas_kernels._common import interpret_default, num_splits, row_blocks
from pallas_kernels.sparse_attention import BLOCK_K, sparse_attention_pallas

RATIO, TAIL, LAYERS = 0.07, 16, 8
SHAPES = {  # name: (B, S, Hq, Hkv, Dh)
    "smollm2_b128": (128, 7936, 9, 3, 64),
    "smollm2_b32": (32, 7936, 9, 3, 64),
    "qwen3_b1_32k": (1, 32768, 32, 8, 128),
    "qwen3_b4_32k": (4, 32768, 32, 8, 128),
}
TINY = {"tiny": (2, 512, 4, 2, 16)}


def time_shape(B, S, Hq, Hkv, Dh, layers):
    """Rows {splits, default, us, GBps} for every split count that fits the selection's blocks."""
    K = math.ceil(RATIO * S)
    rng = np.random.default_rng(0)
    idx = np.stack([[rng.permutation(S - TAIL)[:K]] for _ in range(B)])[None]  # [1, B, 1, K]: one list per row
    idx = jnp.broadcast_to(jnp.asarray(idx, jnp.int32), (layers, B, 1, K))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (layers, B, 1, Hq, Dh), jnp.bfloat16)
    k = jax.random.normal(keys[1], (layers, B, Hkv, S, Dh), jnp.bfloat16)
    v = jax.random.normal(keys[2], (layers, B, Hkv, S, Dh), jnp.bfloat16)
    n_idx, tail = jnp.full((B,), K, jnp.int32), jnp.full((B,), S - TAIL, jnp.int32)
    pos = jnp.full((B, 1), S - 1, jnp.int32)
    n_blocks = row_blocks(1, Hq // Hkv)[0]
    max_blocks = math.ceil(K / BLOCK_K) + math.ceil(TAIL / BLOCK_K)
    default = num_splits(B * Hkv * n_blocks, max_blocks)
    gathered = B * Hkv * (K + TAIL) * Dh * 2 * 2  # K and V rows, bf16
    rows = []
    for splits in sorted({s for s in (1, 2, 3, 4, 6, 8, 16) if s <= max_blocks} | {default}):
        def run(q, k, v, splits=splits):
            def body(total, layer):
                o = sparse_attention_pallas(q[layer], k, v, layer, idx, n_idx, tail, pos, scale=Dh ** -0.5,
                                            tail_capacity=TAIL, n_splits=splits, interpret=interpret_default())
                return total + o.astype(jnp.float32).sum(), None  # all of o: the merge is not pruned
            return lax.scan(body, jnp.float32(0), jnp.arange(layers))[0]

        us = common.seconds_per_call(jax.jit(run), q, k, v) / layers * 1e6
        rows.append({"splits": splits, "default": "yes" if splits == default else "", "us": us, "GBps": gathered / us / 1e3})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    args = p.parse_args()
    result = common.run_info() | {"rates": common.measure_rates(args.tiny), "rows": []}
    for name, shape in (TINY if args.tiny else SHAPES).items():
        for row in time_shape(*shape, layers=2 if args.tiny else LAYERS):
            result["rows"].append({"shape": name, **row})
            print(result["rows"][-1], flush=True)
        common.write_json(args.out / "sparse_splits.json", result)
    print(common.markdown_table(result["rows"], [("shape", "shape", "s"), ("splits", "splits", "d"), ("rule's", "default", "s"),
                                                 ("us per call", "us", ".1f"), ("GB/s gathered", "GBps", ".0f")]))


if __name__ == "__main__":
    main()
