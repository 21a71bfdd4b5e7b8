"""What a compiled decode program costs on its first executions, after its compile.

The serving scheduler compiles its programs ahead of time (`serving.programs.Program.compile`) and counts that as
compile time, but XLA sets up a program's GPU side (its kernels' modules, its command buffers) at its
first executions. A strategy that auto switches to mid-decode pays those inside the decode. This
times the compile, then each of the first executions alone, for plain and vegas on random SmolLM2
weights (`bench/profile_step.py`'s setup), and writes DIR/first_launch_B.json.

    PYTHONPATH=. python3 bench/first_launch.py [--batch 1] [--context 7680] [--calls 6] [--out DIR]
"""

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from bench.throughput import STAGE_REPEATS, spec_for
from jaxspec.models import decoder
from jaxspec.runner import decode_fns


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=7680)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--methods", default="plain,vegas", type=lambda s: s.split(","))
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    cfg, backend = common.SMOLLM2, "pallas" if jax.default_backend() == "gpu" else "reference"
    params = decoder.init_params(cfg, jax.random.key(0))
    max_len, slots, k_max = common.random_lengths(args.context)
    result = common.run_info() | {"batch": args.batch, "context": args.context, "rows": []}
    for method in args.methods:
        spec = spec_for(method, {method: {"gamma": 6, "ratio": 0.07}}, backend,
                        k_max=k_max if method != "plain" else None)
        state = common.random_state(params, cfg, spec, common.random_cache(cfg, args.batch, slots, jax.random.key(1)),
                                    args.context, max_len)
        _, decode = decode_fns(cfg, spec, common.SAMPLINGS["sample"], max_len)
        iterations = jnp.int32(STAGE_REPEATS)
        start = time.perf_counter()
        compiled = decode.lower(params, state, max_iterations=iterations).compile()
        compile_s = time.perf_counter() - start
        calls_ms = []
        for _ in range(args.calls):
            start = time.perf_counter()
            state = jax.block_until_ready(compiled(params, state, max_iterations=iterations))
            calls_ms.append((time.perf_counter() - start) * 1e3)
        row = {"method": method, "iterations_per_call": STAGE_REPEATS, "compile_s": compile_s, "calls_ms": calls_ms}
        result["rows"].append(row)
        print(f"{method}: compile {compile_s:.2f} s; calls of {STAGE_REPEATS} iterations, ms: "
              + ", ".join(f"{t:.1f}" for t in calls_ms))
    common.write_json(args.out / f"first_launch_{args.batch}.json", result)


if __name__ == "__main__":
    main()
