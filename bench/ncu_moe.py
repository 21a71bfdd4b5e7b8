"""The MoE experts kernel under Nsight Compute: where its warps wait.

    PYTHONPATH=. python3 bench/ncu_moe.py [--rows 64] [--format mxfp4|bf16] [--scale-words] [--out DIR]
    PYTHONPATH=. python3 bench/ncu_moe.py --summarize DETAILS.csv SOURCE.csv.gz   (an export's summary; no GPU)

At gpt-oss-20b's shapes with bench/moe.py's random MXFP4 stacks as words (small scales; `--scale-words`:
their scales four to a word, `mxfp4.pack_scales`), or at Qwen3-30B-A3B's with bf16 stacks (`--format
bf16`: one row through the fused form's one kernel, a few rows split K, whose partial sums XLA adds
between its two kernels), it runs itself under `ncu --set full` (clocks as they are, XLA's command
buffers off so that ncu sees each kernel) calling the experts kernel twice in its default form for
--rows (MXFP4 one row: the one-row form; more: row blocks), profiles the second call's kernels,
exports ncu's details page and source page (stall samples per SASS instruction), and writes
DIR/ncu_moe_<rows>_rows_<layout>.txt (layout: byte_scales, scale_words or bf16): each kernel's duration
under the profiler, DRAM throughput, registers, occupancy, issue and eligible warps, its stall reasons,
and its most sampled instructions with their main reason and excessive L2 sectors.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

METRICS = ("Duration", "DRAM Throughput", "Registers Per Thread", "Achieved Occupancy", "Theoretical Occupancy",
           "Issue Slots Busy", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "Grid Size",
           "Waves Per SM", "L2 Hit Rate")
TOP = 8  # instructions listed a kernel


def launch(rows: int, fmt: str, scale_words: bool) -> None:
    """The profiled process: the experts kernel at `rows` rows, jitted, called twice."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels
    from bench import moe as bench_moe
    from pallas_kernels import moe, mxfp4

    shape = bench_moe.SHAPES[fmt]
    stacks = bench_moe.random_stacks(fmt, shape)
    if fmt == "mxfp4":
        stacks = [mxfp4.to_words(w, small_scales=True, scale_words=scale_words) for w in stacks]
    x = jax.random.normal(jax.random.key(rows), (rows, shape["D"]), jnp.bfloat16)
    ids, weights = bench_moe.routing(jax.random.key(1000 + rows), 2, rows, shape["E"], shape["k"])
    call = jax.jit(lambda x, ids, weights, a, b: moe.moe_experts_pallas(
        x, ids, weights, a, b, jnp.int32(1), interpret=pallas_kernels.interpret_default()))
    for r in range(2):
        call(x, ids[r], weights[r], *stacks).block_until_ready()


def profile(rows: int, fmt: str, scale_words: bool, folder: Path) -> tuple[Path, Path]:
    """ncu over `launch`, profiling the second call's kernels (the fused form's one, the others' two):
    its details and source exports."""
    from bench import moe as bench_moe
    from pallas_kernels import moe
    kernels = 1 if moe.default_form(rows, fmt == "mxfp4", bench_moe.SHAPES[fmt]["D"]) == "fused" else 2
    report = folder / "report"
    argv = [sys.executable, __file__, "--launch", "--rows", str(rows), "--format", fmt] + (
        ["--scale-words"] if scale_words else [])
    env = os.environ | {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
    subprocess.run(["ncu", "--clock-control", "none", "-k", "regex:moe_", "--launch-skip", str(kernels),
                    "--launch-count", str(kernels),
                    "--set", "full", "-f", "-o", str(report), *argv], env=env, check=True, stdout=subprocess.DEVNULL)
    details, source = folder / "details.csv", folder / "source.csv.gz"
    imported = ["ncu", "--import", f"{report}.ncu-rep"]
    details.write_bytes(subprocess.run([*imported, "--page", "details", "--csv"], check=True,
                                       capture_output=True).stdout)
    source.write_bytes(gzip.compress(subprocess.run([*imported, "--page", "source", "--csv", "--print-source", "sass"],
                                                    check=True, capture_output=True).stdout))
    return details, source


def summarize(details: Path, source: Path) -> str:
    """The metrics of each kernel in `details` and the stall samples of each in `source` (ncu's CSV pages)."""
    kernels = collections.OrderedDict()
    with open(details) as rows:
        for row in csv.DictReader(rows):
            kernels.setdefault((row["ID"], row["Kernel Name"]), {})[row["Metric Name"]] = \
                f'{row["Metric Value"]} {row["Metric Unit"]}'.strip()
    lines = []
    for (_, name), metrics in kernels.items():
        lines.append(f"{name}: " + "; ".join(f"{m} {metrics[m]}" for m in METRICS if m in metrics))
    text = gzip.open(source, "rt").read().splitlines()
    starts = [i for i, line in enumerate(text) if line.startswith('"Kernel Name"')] + [len(text)]
    for start, end in zip(starts, starts[1:]):
        name = next(csv.reader([text[start]]))[1]
        header, *body = list(csv.reader(io.StringIO("\n".join(text[start + 1:end]))))
        column = {c: i for i, c in enumerate(header)}
        samples = lambda r: float(r[column["Warp Stall Sampling (All Samples)"]] or 0)
        total = sum(map(samples, body)) or 1.0
        reasons = [c for c in header if c.startswith("stall_") and not c.endswith("(Not Issued)")]
        by_reason = {c: sum(float(r[column[c]] or 0) for r in body) for c in reasons}
        lines.append(f"\n{name}: {total:.0f} stall samples; by reason: " + ", ".join(
            f"{c[6:]} {v / total:.0%}" for c, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:6]))
        for r in sorted(body, key=samples, reverse=True)[:TOP]:
            main = max(reasons, key=lambda c: float(r[column[c]] or 0))
            excessive = r[column["L2 Theoretical Sectors Global Excessive"]]
            lines.append(f"  {samples(r) / total:5.1%}  {r[column['Source']].strip()[:64]:64s}  {main[6:]}"
                         + (f", {excessive} excessive L2 sectors" if excessive not in ("", "0") else ""))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64,
                   help="token rows (one: the one-row or the fused form; more: row blocks or split K)")
    p.add_argument("--format", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="gpt-oss-20b's MXFP4 experts as words, or Qwen3-30B-A3B's bf16 experts")
    p.add_argument("--scale-words", action="store_true", help="the scales four to a word (mxfp4.pack_scales)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--summarize", nargs=2, type=Path, metavar=("DETAILS", "SOURCE"),
                   help="summarize ncu's exported details CSV and gzipped source CSV instead of profiling")
    p.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    args = p.parse_args()
    if args.format == "bf16" and args.scale_words:
        p.error("--scale-words is a layout of MXFP4 scales, not of --format bf16")
    if args.launch:
        launch(args.rows, args.format, args.scale_words)
    elif args.summarize:
        if missing := [str(path) for path in args.summarize if not path.is_file()]:
            p.error(f"no such file: {', '.join(missing)}")
        print(summarize(*args.summarize), end="")
    elif shutil.which("ncu") is None:
        p.error("ncu (Nsight Compute) is not on PATH")
    else:
        from bench import common
        info = common.run_info()
        with tempfile.TemporaryDirectory() as folder:
            summary = summarize(*profile(args.rows, args.format, args.scale_words, Path(folder)))
        layout = "bf16" if args.format == "bf16" else "scale_words" if args.scale_words else "byte_scales"
        path = args.out / f"ncu_moe_{args.rows}_rows_{layout}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(f"{info['device']}, {info['date']}: {info['command']}\n\n{summary}")
        path.with_suffix(".tmp").replace(path)
        print(summary, end="")


if __name__ == "__main__":
    main()
