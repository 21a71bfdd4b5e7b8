"""generate's default request through each of the CLI's decode paths, as a user at a terminal gets it.

    PYTHONPATH=. python3 bench/cli_paths.py [--segments 16,64] [--stream-segments 2,64] [--sampling greedy]
        [--new 256] [--repeats 3] [--tiny] [--out DIR] [--tag T]

Why: `python -m jaxspec.generate` decodes in one call when its output goes to a pipe, in segments of
`runner.PROGRESS_SEGMENT` iterations under the progress bar (stderr a terminal), and through a one-slot
serving scheduler in segments when it streams text (stdout a terminal). Each segment's end idles the
device while the host reads, hands out and dispatches the next, which the other benches (one call)
never see. Configs: plain, and auto (generate's plan with the shipped head), each in one call, under the
progress bar at each of `--segments`, and streamed at each of `--stream-segments`; all in one process,
`--repeats` runs each after one that loads the programs. Writes DIR/cli_paths_<device><tag>.json;
prints the table last.
"""

from __future__ import annotations

import argparse
import statistics
import threading

import jax

from bench import common
from bench.default_request import load_request, request_flags
from bench.e2e import spec_of
from jaxspec import runner
from jaxspec.generate import plan_with_head
from jaxspec.loaders.eagle import load_eagle, shipped_head
from jaxspec.models import draft_weights
from jaxspec.runner import resolve_max_len, run_generation
from jaxspec.serving.requests import Request
from jaxspec.serving.scheduler import Scheduler


def batch_rates(weights, cfg, batch, spec, plan, sampling, max_len, new, stop_ids, segment, repeats) -> list[float]:
    """Decode tok/s of `run_generation` (segment None: one call; else the progress bar's segments)."""
    shipped, runner.PROGRESS_SEGMENT = runner.PROGRESS_SEGMENT, segment or runner.PROGRESS_SEGMENT
    rates = []
    try:
        for seed in range(repeats + 1):
            run = run_generation(weights, cfg, batch, spec=spec, sampling=sampling, max_len=max_len, max_new_tokens=new,
                                 stop_ids=stop_ids, seed=seed, plan=plan, progress=segment is not None)
            rates.append(int(run.output.length[0] - run.output.prompt_len[0]) / run.decode_s)
    finally:
        runner.PROGRESS_SEGMENT = shipped
    return rates[1:]


def stream_rates(weights, cfg, tokenizer, ids, spec, plan, sampling, max_len, new, segment, repeats) -> list[float]:
    """Tokens/s after the first token of generate's streamed path (a one-slot scheduler in `segment`s)."""
    scheduler = Scheduler(weights, cfg, tokenizer, spec, slots=1, max_len=max_len, sampling=sampling, plan=plan,
                          segment=segment)
    scheduler.warm_up(len(ids))
    scheduler.start()
    rates = []
    try:
        for seed in range(repeats + 1):
            done, last = threading.Event(), []

            def hear(delta, done=done, last=last):
                if delta.finish_reason is not None:
                    last.append(delta)
                    done.set()

            scheduler.submit(Request(ids, new, sampling, seed), hear)
            done.wait()
            s = last[0].stats
            rates.append(max(s.completion_tokens - 1, 0) / max(s.total_s - s.first_token_s, 1e-9))
    finally:
        scheduler.stop()
    return rates[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--segments", default="16,64", help="progress-bar segment lengths, comma-separated")
    p.add_argument("--stream-segments", default="2,64", help="streamed-path segment lengths, comma-separated")
    p.add_argument("--sampling", default="greedy", help="of bench.common.SAMPLINGS (generate's default: greedy)")
    request_flags(p)
    args = p.parse_args()
    backend, dtype, cfg, params, tokenizer, batch = load_request("smollm2", args.tiny)
    ids = tuple(int(t) for t in batch.ids[0, : batch.lengths[0]])
    max_len = resolve_max_len(batch, args.new, None, cfg.max_position_embeddings)
    sampling = common.SAMPLINGS[args.sampling]
    head_dir = shipped_head("smollm2")
    head, head_params = load_eagle(head_dir, cfg, dtype)
    plain = spec_of("plain", "", backend)
    plan, auto_spec = plan_with_head(cfg, common.tree_bytes(params), plain, head, head_dir, batch=1,
                                     prompt_tokens=len(ids), new_tokens=args.new, sampling=sampling)
    with_head = {**params, "eagle": jax.device_put(head_params)}
    auto_weights = draft_weights.with_draft_weights(with_head, plan.draft_weights)
    paths = ([("one call", False, None)] + [(f"progress bar, {n}", False, int(n)) for n in args.segments.split(",")]
             + [(f"streamed, {n}", True, int(n)) for n in args.stream_segments.split(",")])  # (name, streamed, segment)
    device = "cpu" if args.tiny else jax.devices()[0].device_kind.split()[1].lower()
    path = args.out / f"cli_paths_{device}{args.tag}.json"
    result = common.run_info() | {"sampling": args.sampling, "new": args.new, "plan": plan.first.name, "rows": []}
    for name, weights, spec, plan_of in [("plain", params, plain, None), ("auto", auto_weights, auto_spec, plan)]:
        for path_name, streamed, segment in paths:
            if streamed:
                rates = stream_rates(weights, cfg, tokenizer, ids, spec, plan_of, sampling, max_len, args.new, segment,
                                     args.repeats)
            else:
                rates = batch_rates(weights, cfg, batch, spec, plan_of, sampling, max_len, args.new,
                                    tokenizer.eos_token_ids, segment, args.repeats)
            result["rows"].append({"config": name, "path": path_name, "runs_tokens_per_s": rates,
                                   "tokens_per_s": statistics.median(rates), "spread": max(rates) - min(rates)})
            common.write_json(path, result)
    plain_one = result["rows"][0]["tokens_per_s"]
    for row in result["rows"]:
        row["x_plain_one_call"] = row["tokens_per_s"] / plain_one
    common.write_json(path, result)
    print(common.markdown_table(result["rows"], [
        ("config", "config", "s"), ("path", "path", "s"), ("tok/s (median)", "tokens_per_s", ".0f"),
        ("spread", "spread", ".0f"), ("x plain in one call", "x_plain_one_call", ".2f")]))


if __name__ == "__main__":
    main()
