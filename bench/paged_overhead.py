"""The paged KV cache's cost: a decode iteration through page tables against the contiguous layout it
replaced, at Qwen3-8B shapes, measured in one run.

    git archive <commit before the paged cache> jaxspec pallas_kernels 'bench/*.py' | tar -x -C .gpu/before
    PYTHONPATH=. python3 bench/paged_overhead.py --before .gpu/before [--shapes 1x32768,4x32768,32x8192]
        [--methods plain,vegas | --prefill] [--repeats 3] [--tiny] [--out DIR]

Each repeat runs `bench/profile_step.py --no-trace --stages iteration` (random bf16 weights) once per
shape from each tree, alternating which goes first, in child processes that share a compilation
cache; the iteration's wall time per call is profile_step's (several timed calls after a warm-up).
Per (shape, method, tree): the median over the repeats and their spread, and the paged tree's median
over the contiguous one's (the target: within 1.05). `--prefill`: each tree's prefill of the shapes'
prompts instead (bench/prefill_time.py, the engine's 256-position chunks; the median of its timed calls
per process), written to DIR/paged_prefill_<device>.json. Writes DIR/paged_overhead_<device>.json and
prints the table last.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only launches and reads: the children have the device

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common

HERE = Path(__file__).resolve().parents[1]


def run_tree(tree: Path, batch: int, context: int, methods: list[str], prefill: bool, tiny: bool,
             scratch: Path) -> tuple[dict, dict]:
    """({method: wall ms per call}, the run's info) from `tree`: profile_step's iteration, or (`prefill`:
    {"prefill": ms}) this checkout's prefill_time.py run over `tree`'s jaxspec."""
    name = f"{tree.name}_{batch}_{context}"
    if prefill:
        command = [sys.executable, str(HERE / "bench/prefill_time.py"), "--batch", str(batch), "--context", str(context),
                   "--out", str(scratch / f"{name}.json")]
    else:
        command = [sys.executable, "bench/profile_step.py", "--model", "qwen3-8b", "--batch", str(batch), "--context",
                   str(context), "--methods", ",".join(methods), "--no-trace", "--stages", "iteration", "--out", str(scratch),
                   "--name", name]
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}, "PYTHONPATH": str(tree),
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/jaxspec_jit_cache")}
    done = subprocess.run(command + (["--tiny"] if tiny else []), cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{Path(command[1]).name} failed in {tree}:\n{done.stderr[-3000:]}")
    result = json.loads((scratch / f"{name}.json").read_text())
    info = {k: result[k] for k in ("device", "backend", "jax")}
    if prefill:
        return {"prefill": statistics.median(result["prefill_ms"])}, info
    return {r["method"]: r["wall_ms"] for r in result["stages"] if r["stage"] == "iteration"}, info


def summarize(times: dict, shapes: list, methods: list, trees: dict) -> list[dict]:
    """Per (shape, method): each tree's median and spread over the repeats so far, and their ratio
    (written after every repeat, so a run cut short keeps what it measured)."""
    rows = []
    for batch, context in shapes:
        for method in methods:
            got = {name: times[batch, context, method, name] for name in trees}
            median = {name: statistics.median(v) for name, v in got.items()}
            rows.append({"batch": batch, "context": context, "method": method,
                         **{f"{name}_ms": median[name] for name in trees},
                         **{f"{name}_spread_ms": max(v) - min(v) for name, v in got.items()},
                         "paged_over_contiguous": median["paged"] / median["contiguous"], "runs": got})
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True, help="a tree of the contiguous layout (jaxspec, pallas_kernels, bench)")
    p.add_argument("--shapes", default="1x32768,4x32768,32x8192",
                   type=lambda s: [tuple(int(n) for n in x.split("x")) for x in s.split(",")])
    p.add_argument("--methods", default="plain,vegas", type=lambda s: s.split(","))
    p.add_argument("--prefill", action="store_true", help="time a whole prompt's prefill instead (bench/prefill_time.py)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="profile_step's tiny sizes: a CPU smoke run")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    trees = {"contiguous": args.before.resolve(), "paged": HERE}
    if args.prefill:
        args.methods = ["prefill"]  # the table's one row per shape
    times: dict = {}  # (batch, context, method, tree): [ms per repeat]
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for batch, context in args.shapes:
                order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
                for name in order:
                    got, info = run_tree(trees[name], batch, context, args.methods, args.prefill, args.tiny, Path(scratch))
                    for method, ms in got.items():
                        times.setdefault((batch, context, method, name), []).append(ms)
                    print(f"repeat {repeat} {batch}x{context} {name}: done", flush=True)
            rows = summarize(times, args.shapes, args.methods, trees)
            result = {**common.run_info(), **info, "before": str(args.before), "repeats": repeat + 1, "rows": rows}
            stem = "paged_prefill" if args.prefill else "paged_overhead"
            common.write_json(args.out / f"{stem}_{result['device'].split(' (')[0].replace(' ', '_')}.json", result)
    print(common.markdown_table(rows, [("batch", "batch", "d"), ("context", "context", "d"), ("method", "method", "s"),
                                       ("contiguous ms", "contiguous_ms", ".3f"), ("spread", "contiguous_spread_ms", ".3f"),
                                       ("paged ms", "paged_ms", ".3f"), ("spread", "paged_spread_ms", ".3f"),
                                       ("paged / contiguous", "paged_over_contiguous", ".3f")]))


if __name__ == "__main__":
    main()
