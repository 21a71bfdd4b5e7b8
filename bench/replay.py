"""What the planner's watch pays for a replay of ngram (`Ngram.replay`) at a window's end.

    PYTHONPATH=. python3 bench/replay.py [--shapes 32x2304,128x2304,8x8704] [--gammas 4,8]
        [--windows 64,384,1024] [--repeats 5] [--tiny] [--out DIR]

Rows of random tokens whose second half repeats a stretch of the first (matches for the chains to
walk), a window of each length from the middle of the row. Timed: one jitted replay of rows already on
the device called and waited on, back-to-back, 10 calls a run, median of --repeats runs, ms a call:
what a watch boundary waits for (its launch and the host's wait included). Checked: the iterations
equal a walk that calls `Ngram.propose` at each length (on the first row, the first window). Writes
DIR/replay.json and prints a table last.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec.decoding.drafters import make_drafter
from jaxspec.decoding.spec import SpecConfig
from jaxspec.decoding.tree import TreeShape

CALLS = 10


def rows_of(B: int, N: int, rng) -> np.ndarray:
    """[B, N] tokens: random, the second half repeating 100 tokens of the first."""
    tokens = rng.integers(0, 3000, (B, N)).astype(np.int32)
    half = N // 2
    tokens[:, half:] = np.tile(tokens[:, half // 2: half // 2 + 100], (1, N // 100 + 1))[:, : N - half]
    return tokens


def walked(drafter, tokens: np.ndarray, start: int, end: int, gamma: int) -> int:
    """Iterations of a walk from `start` to `end` of one row calling `propose` at each length."""
    propose = jax.jit(lambda t, length: drafter.propose(t, length, TreeShape.chain(gamma))[:, 1:])
    length, iterations = start, 0
    while length < end:
        drafts = np.asarray(propose(jnp.asarray(tokens[None]), jnp.asarray([length], jnp.int32)))[0]
        accepted = 0
        while accepted < gamma and length + accepted < end and drafts[accepted] == tokens[length + accepted]:
            accepted += 1
        length, iterations = length + accepted + 1, iterations + 1
    return iterations


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="32x2304,128x2304,8x8704", help="rows x tokens, comma-separated")
    p.add_argument("--gammas", default="4,8")
    p.add_argument("--windows", default="64,384,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small shapes: a CPU smoke test of this script")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    shapes = [(2, 256)] if args.tiny else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    windows = [16, 64] if args.tiny else [int(w) for w in args.windows.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    rng = np.random.default_rng(0)
    result, rows = common.run_info() | {"rows": []}, []
    path = args.out / "replay.json"
    for B, N in shapes:
        tokens = rows_of(B, N, rng)
        for gamma in gammas:
            drafter = make_drafter(SpecConfig(method="ngram", gamma=gamma), None, N)
            replay = jax.jit(drafter.replay)
            for w in windows:
                start = np.full((B,), N // 2 - w // 2, np.int32)
                end = np.minimum(start + w, N).astype(np.int32)
                inputs = jax.device_put((tokens, start, end))  # on the device once, as the state's tokens are
                got = np.asarray(replay(*inputs))
                if w == windows[0]:
                    assert got[0] == walked(drafter, tokens[0], int(start[0]), int(end[0]), gamma), (B, N, gamma)
                runs = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    for _ in range(CALLS):
                        replay(*inputs).block_until_ready()
                    runs.append((time.perf_counter() - t) / CALLS * 1e3)
                row = {"rows": B, "tokens": N, "gamma": gamma, "window": w, "ms": statistics.median(runs),
                       "spread_ms": max(runs) - min(runs), "iterations_mean": float(got.mean())}
                rows.append(row)
                result["rows"] = rows
                common.write_json(path, result)
    print("| rows x tokens | gamma | window | ms a replay | spread | iterations (mean row) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} x {r['tokens']} | {r['gamma']} | {r['window']} | {r['ms']:.2f} | {r['spread_ms']:.2f} | "
              f"{r['iterations_mean']:.1f} |")


if __name__ == "__main__":
    main()
