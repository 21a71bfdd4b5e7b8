"""The top-p threshold at few and many rows (issue 16): pallas_kernels/top_p.py's one-program-per-row
kernel ("per_row") against its split path ("split": each row over many programs; "split_CxP": chunks of
C logits, P a program), and "auto" (top_p_threshold_pallas: the rule's choice). Imports pallas_kernels only.

    PYTHONPATH=. python3 bench/top_p.py [--rows 1,2,8,32,64,128] [--vocabs 49152,151936]
        [--methods per_row,split,split_1024x1,auto] [--logits normal,zipf] [--repeats 5] [--profile] [--tag T] [--out DIR]

Logits (float32), T 0.7, top-p 0.95: "normal", 3 x N(0, 1) as bench/sampling.py, a flat row (a third of
a 49K vocabulary within the bound the per-row path keeps), or "zipf", shaped like SmolLM2's real rows
(`logits_of`). Each method is checked on the
GPU against top_p_threshold_reference (rows equal; where one differs, the float64 |M(t) - top_p Z| / Z
at the lower of the two thresholds: rounding-level means a near-tie). Timed: CALLS calls in one jitted
function (each with its own top_p, so XLA keeps them all; one dispatch for all; the first call's
thresholds are the ones checked), back-to-back for at least 20 ms, median of --repeats runs, in us per
call: launch gaps included, dispatch not. Floor: the row's bytes read once at the copy bandwidth
measured in the same run. --profile adds the per-kernel device times of one auto call at the smallest
row count and largest vocabulary. Writes DIR/top_p_<device><tag>.json after every shape.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import interpret_default
from pallas_kernels.top_p import (
    top_p_threshold_pallas,
    top_p_threshold_per_row,
    top_p_threshold_reference,
    top_p_threshold_split,
)

INV_T, TOP_P = 1 / 0.7, 0.95
CALLS = 16


def check_and_time(fn, x, repeats: int):
    """(the thresholds of fn at TOP_P, us per call)."""
    f = jax.jit(lambda x: jnp.stack([fn(x, INV_T, TOP_P - 1e-7 * i) for i in range(CALLS)]))
    got = np.asarray(f(x))[0]

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            out = f(x)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    n = max(1, math.ceil(0.02 / run(1)))
    return got, statistics.median(run(n) for _ in range(repeats)) / CALLS * 1e6


def logits_of(kind: str, R: int, V: int, seed: int):
    """normal: 3 x N(0, 1). zipf: -1.5 ln(rank) + 0.3 x N(0, 1), ranks in a random order per row. At T
    0.7 and V 49152 its rows match 400 positions of SmolLM2 on real text (CPU, float32): a 0.95
    nucleus of 9 tokens (SmolLM2: 8), ending 4.5 below the max (4.1), with 44 values within 8 of it (42)
    and 276 within 12 (264), medians."""
    key = jax.random.key(seed)
    if kind == "normal":
        return 3 * jax.random.normal(key, (R, V), jnp.float32)
    order, noise = jax.random.split(key)
    ranks = jax.vmap(lambda k: jax.random.permutation(k, V))(jax.random.split(order, R)) + 1
    return -1.5 * jnp.log(ranks.astype(jnp.float32)) + 0.3 * jax.random.normal(noise, (R, V), jnp.float32)


def copy_GBps() -> float:
    x = jnp.ones((1 << 27,), jnp.float32)  # 512 MiB, well past L2
    f = jax.jit(lambda x: x + 1)
    jax.block_until_ready(f(x))
    start = time.perf_counter()
    for _ in range(20):
        out = f(x)
    jax.block_until_ready(out)
    return 2 * x.nbytes * 20 / (time.perf_counter() - start) / 1e9


def near_tie_gap(x, a, b) -> float:
    """The largest float64 |M(t) - top_p Z| / Z over rows where a and b differ, at t = min(a, b)."""
    x = np.asarray(jnp.asarray(x, jnp.float32) * jnp.float32(INV_T), np.float64)
    gaps = [0.0]
    for r in np.flatnonzero(a != b):
        e = np.exp(x[r] - x[r].max())
        gaps.append(abs(e[x[r] > min(a[r], b[r])].sum() - TOP_P * e.sum()) / e.sum())
    return float(max(gaps))


def kernel_times(fn, x) -> list:
    """[(kernel name, us)] of one call under jax.profiler."""
    f = jax.jit(lambda x: fn(x, INV_T, TOP_P))
    jax.block_until_ready(f(x))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(f(x))
        path = sorted(Path(trace_dir).rglob("*.xplane.pb"))[-1]
        data = jax.profiler.ProfileData.from_file(str(path))
    plane = [p for p in data.planes if p.name.startswith("/device:GPU")][0]
    events = sorted((e.start_ns, e.name, e.duration_ns) for line in plane.lines if line.name.startswith("Stream")
                    for e in line.events if e.duration_ns > 0)
    return [(name, duration / 1e3, (start - events[0][0]) / 1e3) for start, name, duration in events]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,8,32,64,128")
    p.add_argument("--vocabs", default="49152,151936")
    p.add_argument("--methods", default="per_row,split,auto")
    p.add_argument("--logits", default="normal", help="normal,zipf (logits_of)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    vocabs = [int(v) for v in args.vocabs.split(",")]
    interpret = interpret_default()  # a CPU smoke run
    paths = {"per_row": top_p_threshold_per_row, "split": top_p_threshold_split, "auto": top_p_threshold_pallas}
    methods = {}
    for name in args.methods.split(","):
        if name.startswith("split_"):
            chunk, per = map(int, name.removeprefix("split_").split("x"))
            methods[name] = functools.partial(top_p_threshold_split, chunk=chunk, per=per, interpret=interpret)
        else:
            methods[name] = functools.partial(paths[name], interpret=interpret)
    rate = copy_GBps()
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(["python3"] + sys.argv),
              "copy_GBps": rate, "calls_per_jit": CALLS, "rows": []}
    device = "cpu" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind.split()[1].lower()
    out = args.out / f"top_p_{device}{args.tag}.json"
    print(f"copy bandwidth {rate:.0f} GB/s", flush=True)
    for kind, V, R in itertools.product(args.logits.split(","), vocabs, rows_list):
        x = logits_of(kind, R, V, R + V)
        ref = np.asarray(jax.jit(top_p_threshold_reference)(x, INV_T, TOP_P))
        row = {"logits": kind, "rows": R, "vocab": V, "floor_us": R * V * 4 / (rate * 1e9) * 1e6}
        for name, fn in methods.items():
            start = time.perf_counter()
            got, us = check_and_time(fn, x, args.repeats)
            row[name] = {"equal_ref": int(np.sum(got == ref)), "gap": near_tie_gap(x, got, ref),
                         "us": us, "seconds": time.perf_counter() - start}
        result["rows"].append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"{kind} V={V} rows={R} floor {row['floor_us']:.2f} us: " + ", ".join(
            f"{n} {row[n]['us']:.1f} us ({row[n]['equal_ref']}/{R}, {row[n]['seconds']:.0f} s)" for n in methods), flush=True)
    if args.profile:
        x = 3 * jax.random.normal(jax.random.key(0), (min(rows_list), max(vocabs)), jnp.float32)
        kernels = kernel_times(functools.partial(top_p_threshold_pallas, interpret=interpret), x)
        result["profile"] = {"rows": min(rows_list), "vocab": max(vocabs), "kernels": kernels}
        out.write_text(json.dumps(result, indent=1))
        for name, us, at in result["profile"]["kernels"]:
            print(f"  {at:8.1f} us  {us:7.2f} us  {name}")


if __name__ == "__main__":
    main()
