"""Serving in process, by segment length: the `Scheduler` without HTTP, and where its thread's time goes.

    PYTHONPATH=. python3 bench/serve_segments.py [--model smollm2] [--methods plain,vegas] [--segments 2,8,none]
        [--slots 16] [--prompt-tokens 1000] [--new 1024] [--repeats 2] [--tiny] [--out DIR] [--tag T]

Per method and segment length (`none`: one segment to the end, as the CLI's batch runs): a scheduler
(gamma 6 and ratio 0.07 for a drafter, the server's defaults otherwise) is warmed up and serves one
request end to end; then --slots requests (real-text prompts of about --prompt-tokens tokens through
the chat template, --new tokens each, T 0.7 / top-p 0.95, fixed seeds) are submitted at once, --repeats
times. Per run: completion tok/s from the submission to the last token, tok/s while every request
runs (from the last first token to the first finish), and the scheduler thread's seconds in its
calls by program, in reading and handing out reports (`_hand_out`), in whole deliveries, and in a
segment's delivery (`_deliver_segment`, which waits for the segment to end: the programs that take
the state run queued on the dispatch thread). The gap between this and `bench/serve_load.py` is the HTTP
server's; the gap to `none` is the segments' (bench/NOTES.md, "Serving: where a 16-slot segment's time
went"). Writes DIR/serve_segments_<device><tag>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from pathlib import Path

from bench import common
from bench.serve_load import GAMMA, RATIO, prompts
from jaxspec.decoding.spec import spec_from_settings
from jaxspec.loaders import load_model
from jaxspec.serving.requests import Request
from jaxspec.serving.scheduler import Scheduler

TABLE = [("method", "method", "s"), ("segment", "segment", "s"), ("repeat", "repeat", "d"), ("tok/s", "tokens_per_s", ".0f"),
         ("tok/s all running", "running_tokens_per_s", ".0f"), ("deliveries", "deliveries", "d"),
         ("segment ms/delivery", "segment_ms", ".2f"), ("hand-out ms/delivery", "hand_out_ms", ".2f"),
         ("delivery ms", "deliver_ms", ".2f")]


def timed(scheduler: Scheduler, seconds: collections.Counter, counts: collections.Counter) -> None:
    """Wraps the scheduler's calls, hand-outs and deliveries with timers (this scheduler only)."""
    for name in ("_call", "_hand_out", "_deliver", "_deliver_segment"):
        method = getattr(scheduler, name)

        def wrapper(*args, _method=method, _name=name, **kwargs):
            key = f"{_name}:{args[0].name}" if _name == "_call" else _name
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start
                counts[key] += 1

        setattr(scheduler, name, wrapper)


def serve(scheduler: Scheduler, ids: list[list[int]], new: int, first_seed: int) -> dict:
    """Submits every prompt at once; returns the run's figures once all have finished."""
    times, done, lock, left = collections.defaultdict(list), threading.Event(), threading.Lock(), [len(ids)]

    def listener(i):
        def on_delta(delta):
            times[i].append((time.perf_counter(), len(delta.token_ids)))
            if delta.finish_reason:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        return on_delta

    start = time.perf_counter()
    for i, prompt in enumerate(ids):
        scheduler.submit(Request(tuple(prompt), new, common.SAMPLINGS["sample"], seed=first_seed + i), listener(i))
    done.wait()
    wall = time.perf_counter() - start
    tokens = sum(n for deltas in times.values() for _, n in deltas)
    all_in, first_end = max(d[0][0] for d in times.values()), min(d[-1][0] for d in times.values())
    window = [n for d in times.values() for t, n in d if all_in < t <= first_end]
    steady = len(window) >= 2 * len(times)  # else one segment, or a request that ended in its first deliveries
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "running_tokens_per_s": sum(window) / (first_end - all_in) if steady else None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--methods", default="plain,vegas", type=lambda s: s.split(","))
    p.add_argument("--segments", default="2,8,none", type=lambda s: [None if x == "none" else int(x) for x in s.split(",")])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, reference backend, 2 slots, short requests")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tag", default="", help="suffix of the file name")
    args = p.parse_args()
    if args.tiny:
        args.slots, args.prompt_tokens, args.new, args.repeats = 2, 100, 12, 1
    info = common.run_info()
    cfg, params, tokenizer = load_model(args.model, "float32" if args.tiny else "bfloat16")
    backend = "reference" if args.tiny else "pallas"
    ids = prompts(tokenizer, args.slots, (args.prompt_tokens, args.prompt_tokens))
    max_len = min(cfg.max_position_embeddings, max(len(x) for x in ids) + args.new + 1)
    result = {**info, "model": args.model, "slots": args.slots, "prompt_tokens": [len(x) for x in ids], "new": args.new,
              "runs": []}
    path = args.out / f"serve_segments_{info['device'].split(' (')[0].replace(' ', '_')}{args.tag}.json"
    for method in args.methods:
        drafts = {} if method == "plain" else {"gamma": GAMMA, "ratio": RATIO}
        spec = spec_from_settings(method, backend=backend, **drafts)
        for segment in args.segments:
            for repeat in range(args.repeats):
                scheduler = Scheduler(params, cfg, tokenizer, spec, slots=args.slots, max_len=max_len, segment=segment)
                scheduler.warm_up(max(len(x) for x in ids))
                scheduler.start()
                try:
                    serve(scheduler, ids[:1], 8, first_seed=10_000)  # what warm_up leaves to a first request
                    seconds, counts = collections.Counter(), collections.Counter()
                    timed(scheduler, seconds, counts)
                    run = serve(scheduler, ids, args.new, first_seed=repeat * len(ids))
                finally:
                    scheduler.stop()
                deliveries = counts["_hand_out"]  # the segments' and the admissions'
                run.update(method=method, segment=str(segment), repeat=repeat, deliveries=deliveries,
                           seconds_in={k: round(v, 4) for k, v in seconds.items()}, calls=dict(counts),
                           segment_ms=seconds["_deliver_segment"] / deliveries * 1e3,
                           hand_out_ms=seconds["_hand_out"] / deliveries * 1e3, deliver_ms=seconds["_deliver"] / deliveries * 1e3)
                result["runs"].append(run)
                common.write_json(path, result)
                print(f"{method} segment {segment} repeat {repeat}: {run['tokens_per_s']:.0f} tok/s", flush=True)
    print(common.markdown_table(result["runs"], TABLE))


if __name__ == "__main__":
    main()
