"""Prefill time of one long prompt at Qwen3-8B shapes (random bf16 weights): the time to first token's
main part, for comparing two trees of jaxspec (bench/paged_overhead.py --prefill runs this file with
each tree's PYTHONPATH, so it uses only what both have: runner.prefill_fn, decoder.init_params and
bench/common's QWEN3_8B, bench/decode's TINY_CFG).

    PYTHONPATH=<tree> python3 bench/prefill_time.py --out FILE [--batch 1] [--context 32768] [--chunk 256] [--calls 3]

Writes {"device", "prefill_ms": [per call], ...} to FILE (JSON) after a warm-up call.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp

from bench.common import QWEN3_8B, random_prompts
from bench.decode import TINY_CFG
from jaxspec.models import decoder
from jaxspec.runner import prefill_fn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=256, help="positions a prefill chunk (the engine's default)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke run at bench/decode.py's tiny sizes")
    args = p.parse_args()
    cfg = TINY_CFG if args.tiny else QWEN3_8B
    params = decoder.init_params(cfg, jax.random.key(0))
    ids, lengths = random_prompts(cfg, args.batch, args.context)
    ids, lengths = jnp.asarray(ids), jnp.asarray(lengths)
    fill = prefill_fn(cfg, args.context + 64, "pallas" if jax.default_backend() == "gpu" else "reference", args.chunk)
    jax.block_until_ready(fill(params, ids, lengths))  # compile and warm up
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        jax.block_until_ready(fill(params, ids, lengths))
        times.append((time.perf_counter() - start) * 1e3)
    with open(args.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
                   "batch": args.batch, "context": args.context, "chunk": args.chunk, "prefill_ms": times}, f)


if __name__ == "__main__":
    main()
