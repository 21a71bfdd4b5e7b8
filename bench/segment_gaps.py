"""What a segment boundary costs the device, emulated on the CPU (no GPU needed).

    PYTHONPATH=. python3 bench/segment_gaps.py [--segments 2,16,64] [--server-slots 4] [--new 513] [--step-ms 1.0]
                                               [--repeats 5] [--out bench/results] [--tag T]

On a GPU a decode segment's call returns only once its loop has ended (XLA reads a while loop's
condition on the host every iteration), so between two segments the device idles while the host
works. On the CPU the call returns at once and the host's work overlaps the loop, so nothing shows.
This script makes the CPU behave like the GPU: every compiled decode program's call waits for its
outputs and then sleeps `--step-ms` for each iteration it ran (an emulated device that holds no core
and no GIL), and records when each call began and ended. A tiny random model (bench/decode.py's,
float32) decodes one 64-token prompt for `--new` tokens through `runner.run_generation`, in one call
and under the progress bar at each of `--segments` iterations a segment (`runner.PROGRESS_SEGMENT`);
and as a server runs: `--server-slots` requests of as many tokens, admitted at once into a scheduler
of as many slots, in segments of 2 (`serve`'s default); per configuration: ms per decode step and the
mean gap between one segment's end and the next one's start (the device's idle time a boundary),
medians over `--repeats` runs after a first one.
To set two trees against each other, run it with PYTHONPATH at each (the emulation patches only
`serving.programs.Program.compile`, which both have).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from bench import common
from bench.decode import TINY_CFG
from jaxspec import runner
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.models import decoder
from jaxspec.serving import programs
from jaxspec.serving.requests import Request
from jaxspec.serving.scheduler import Scheduler

TABLE = [("path", "path", "s"), ("ms / step", "ms_per_step", ".4f"), ("spread", "ms_per_step_spread", ".4f"),
         ("gap ms / boundary", "gap_ms", ".3f"), ("gap spread", "gap_ms_spread", ".3f"),
         ("boundaries", "boundaries", "d")]


class Emulated:
    """A compiled decode whose call returns once its outputs are ready and the emulated device has spent
    `step` seconds on each iteration it ran; each call's (start, end) goes to `calls`."""

    def __init__(self, executable, step: float, calls: list):
        self.executable, self.step, self.calls = executable, step, calls

    def __call__(self, *args):
        start = time.perf_counter()
        before = int(np.max(jax.device_get(args[1].stats.iterations)))
        out = self.executable(*args)
        state = out[0] if isinstance(out, tuple) else out
        time.sleep(self.step * (int(np.max(jax.device_get(state.stats.iterations))) - before))
        self.calls.append((start, time.perf_counter()))
        return out

    def __getattr__(self, name):
        return getattr(self.executable, name)


def emulate(step: float, calls: list) -> None:
    """Every decode program compiled from now on is `Emulated`."""
    compile_ = programs.Program.compile

    def compile(self, *args):
        executable, seconds = compile_(self, *args)
        return (Emulated(executable, step, calls) if self.name == "decode" else executable), seconds

    programs.Program.compile = compile


def serve(params, cfg, spec: SpecConfig, slots: int, new: int, max_len: int) -> float:
    """Seconds from admission to the last token of `slots` requests of `new` tokens (64-token prompts,
    greedy), admitted at once into a scheduler of `slots` slots in segments of 2."""
    scheduler, done = Scheduler(params, cfg, None, spec, slots=slots, max_len=max_len, stop_ids=()), []

    def hear(delta):
        if delta.finish_reason is not None:
            done.append(delta)

    for i in range(slots):
        ids = tuple(np.random.default_rng(i).integers(0, cfg.vocab_size, 64).tolist())
        scheduler.submit(Request(ids, new, SamplingConfig(), i), hear)
    scheduler.admit_waiting()
    start = time.perf_counter()
    while len(done) < slots:
        scheduler.step()
    scheduler.stop()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segments", default="2,16,64")
    p.add_argument("--server-slots", type=int, default=4)
    p.add_argument("--new", type=int, default=513)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--tag", default="")
    args = p.parse_args()

    calls: list = []
    emulate(args.step_ms * 1e-3, calls)
    cfg = dataclasses.replace(TINY_CFG, dtype="float32")
    params = decoder.init_params(cfg, jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 64)).astype(np.int32)
    batch = runner.Batch(ids, np.asarray([64], np.int32))
    spec = SpecConfig(method="plain", backend="reference").validate()
    settings = dict(spec=spec, sampling=SamplingConfig(), max_len=64 + args.new, max_new_tokens=args.new, stop_ids=())
    tree = Path(runner.__file__).resolve().parents[1]  # the jaxspec measured (PYTHONPATH)
    result = {**common.run_info(), "tree": str(tree), "step_ms": args.step_ms, "new": args.new, "rows": []}
    paths = ([("one call", None)] + [(f"segments of {s}", int(s)) for s in args.segments.split(",")]
             + [(f"server, {args.server_slots} slots, segments of 2", "server")])
    for name, segment in paths:
        runner.PROGRESS_SEGMENT = segment if isinstance(segment, int) else runner.PROGRESS_SEGMENT
        steps, gaps = [], []
        for _ in range(args.repeats + 1):
            calls.clear()
            if segment == "server":
                seconds = serve(params, cfg, spec, args.server_slots, args.new, settings["max_len"])
            else:
                seconds = runner.run_generation(params, cfg, batch, progress=segment is not None, **settings).decode_s
            segments = [c for c in calls if c[1] - c[0] > args.step_ms * 1e-3 / 2]  # not a program's load
            steps.append(seconds / (args.new - 1) * 1e3)
            gaps.append(statistics.mean([b[0] - a[1] for a, b in zip(segments, segments[1:])] or [0.0]) * 1e3)
        steps, gaps = steps[1:], gaps[1:]  # the first run compiles
        result["rows"].append(dict(path=name, ms_per_step=statistics.median(steps), gap_ms=statistics.median(gaps),
                                   ms_per_step_spread=max(steps) - min(steps), gap_ms_spread=max(gaps) - min(gaps),
                                   boundaries=len(segments) - 1, runs_ms_per_step=steps, runs_gap_ms=gaps))
        print(f"{name}: {result['rows'][-1]['ms_per_step']:.4f} ms a step, gap {result['rows'][-1]['gap_ms']:.3f} ms",
              flush=True)
    common.write_json(args.out / f"segment_gaps_cpu{args.tag}.json", result)
    print(common.markdown_table(result["rows"], TABLE))


if __name__ == "__main__":
    main()
