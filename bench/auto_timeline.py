"""Where an auto run spends the time its first strategy run whole does not: the scheduler's calls on a timeline.

    PYTHONPATH=. python3 bench/auto_timeline.py [--model smollm2] [--batch 32] [--prompt-tokens 1000] [--new 1024]
        [--request] [--sampling sample] [--repeats 3] [--tiny] [--out DIR] [--tag T]

Random SmolLM2-shaped weights and random prompts (the text never repeats, so auto's watch never
switches: the case of a closed batch settled on plain), or with --model the model and held-out real-text
prompts, auto planned with its shipped head as generate plans it (a plan that starts plain only);
sampled (T 0.7, top-p 0.95) unless --sampling greedy. With --request, generate's default request (its
prompt through the chat template, one row; `--new 256` is generate's default) with the model (default
smollm2) and its shipped head, planned as generate plans it. Per repeat, in one process, alternating:
the plan's first strategy run whole (plain for a plan that starts plain) and auto through
`runner.run_generation` (decode seconds as the CLI and bench/e2e.py time them), then one auto run whose
scheduler calls are logged (host start and end of each LOGGED method, relative to the decode's start),
and one whose every call is waited on (`jax.block_until_ready`: each call's device time, the run slower
by its syncs). The gap (auto's decode seconds less its segments' observed seconds) is time no segment
saw. Writes DIR/auto_timeline_<device><tag>.json and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from bench.default_request import load_request
from jaxspec import planner
from jaxspec.decoding.spec import SpecConfig
from jaxspec.generate import plan_with_head
from jaxspec.loaders import load_model
from jaxspec.loaders.eagle import load_eagle, shipped_head
from jaxspec.models import decoder, draft_weights
from jaxspec.runner import Batch, prefill_fn, resolve_max_len, run_generation
from jaxspec.serving.scheduler import Scheduler

LOGGED = ("_call", "_queue", "_load", "_executable", "_deliver", "_hand_out", "_replays", "_run_watched", "run_segment")
TABLE = [("repeat", "repeat", "d"), ("first strategy whole s", "whole_s", ".4f"), ("auto s", "auto_s", ".4f"),
         ("auto x whole", "ratio", ".4f"), ("segments s", "segments_s", ".4f"), ("gap ms", "gap_ms", ".2f")]


@contextlib.contextmanager
def logged(events: list, sync: bool):
    """Every Scheduler's LOGGED methods append (name, program, start, end) to `events` (perf_counter
    seconds); with `sync`, each `_call` waits for its result."""
    saved = {name: getattr(Scheduler, name) for name in LOGGED}

    def wrap(name, method):
        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            out = method(self, *args, **kwargs)
            if sync and name == "_call":
                jax.block_until_ready(out)
            label = getattr(args[0], "name", "") if name in ("_call", "_queue", "_load", "_executable") else ""
            events.append((name, label, start, time.perf_counter()))
            return out
        return wrapper

    for name, method in saved.items():
        setattr(Scheduler, name, wrap(name, method))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Scheduler, name, method)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model to load (default: random SmolLM2-shaped weights)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--request", action="store_true", help="generate's default request (one row) and its plan")
    p.add_argument("--sampling", default="sample", help="of bench.common.SAMPLINGS")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, reference backend, 4 rows, short")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if args.tiny:
        args.batch, args.prompt_tokens, args.new, args.repeats = 4, 64, 40, 1
    backend = "reference" if args.tiny else "pallas"
    sampling, plain = common.SAMPLINGS[args.sampling], SpecConfig(backend=backend)
    spec, cache = plain, None
    if args.request:
        args.model = args.model or "smollm2"
        _, dtype, cfg, params, tokenizer, batch = load_request(args.model, args.tiny)
        args.batch, args.prompt_tokens = 1, int(batch.lengths[0])
        max_len = resolve_max_len(batch, args.new, None, cfg.max_position_embeddings)
        head_dir = shipped_head(args.model)
        head, head_params = load_eagle(head_dir, cfg, dtype) if head_dir else (None, None)
        params = params if head is None else {**params, "eagle": jax.device_put(head_params)}
        plan, spec = plan_with_head(cfg, common.tree_bytes(params), plain, head, head_dir, batch=1,
                                    prompt_tokens=args.prompt_tokens, new_tokens=args.new, sampling=sampling)
    elif args.model:
        cfg, params, tokenizer = load_model(args.model, "float32" if args.tiny else "bfloat16")
        head_dir = shipped_head(args.model)
        head = head_dir and load_eagle(head_dir, cfg, cfg.dtype)[0]
        batch, max_len, cache = common.real_text_batch(cfg, params, tokenizer, args.batch, args.prompt_tokens, args.new,
                                                       backend, heldout=True)
        plan, _ = plan_with_head(cfg, common.tree_bytes(params), plain, head, head_dir, batch=args.batch,
                                 prompt_tokens=int(batch.lengths.max()), new_tokens=args.new, sampling=sampling)
    else:
        cfg = common.SMOLLM2 if not args.tiny else dataclasses.replace(common.SMOLLM2, num_layers=2, dtype="float32")
        params = decoder.init_params(cfg, jax.random.key(0))
        ids, lengths = common.random_prompts(cfg, args.batch, args.prompt_tokens)
        batch, max_len = Batch(ids, lengths), args.prompt_tokens + args.new
        cache = prefill_fn(cfg, max_len, backend, 256)(params, jnp.asarray(ids), jnp.asarray(lengths))
        plan = planner.make_plan(cfg, common.tree_bytes(params), batch=args.batch, prompt_tokens=args.prompt_tokens,
                                 new_tokens=args.new, sampling=sampling)
    if not (args.request or plan.first.plain):  # a drafter needs its state in the prefilled cache
        p.error(f"the plan starts with {plan.first.name}, not plain: without --request this bench times plain plans")
    with_copies = draft_weights.with_draft_weights(params, plan.draft_weights)  # the plan's draft copies, as generate
    info = common.run_info()
    result = {**info, "model": args.model or "random smollm2 shapes", "batch": args.batch,
              "prompt_tokens": args.prompt_tokens, "new": args.new, "planned": plan.describe(), "rows": []}
    path = args.out / f"auto_timeline_{info['device'].split(' (')[0].replace(' ', '_')}{args.tag}.json"

    whole = plan.first.spec(spec)

    def run(with_plan: bool, seed: int):
        return run_generation(with_copies if with_plan else params, cfg, batch, spec=spec if with_plan else whole,
                              sampling=sampling, max_len=max_len, max_new_tokens=args.new,
                              stop_ids=tokenizer.eos_token_ids if args.request else (), seed=seed,
                              cache=None if cache is None else jax.tree.map(jnp.copy, cache),
                              plan=plan if with_plan else None)

    run(False, 99), run(True, 99)  # compiles and first executions
    for repeat in range(args.repeats):
        whole_run, auto_run = run(False, repeat), run(True, repeat)
        segments_s = sum(s["iterations"] * s["iteration_s"] for s in auto_run.auto.segments)
        row = {"repeat": repeat, "whole_s": whole_run.decode_s, "auto_s": auto_run.decode_s,
               "ratio": whole_run.decode_s / auto_run.decode_s, "segments_s": segments_s,
               "gap_ms": (auto_run.decode_s - segments_s) * 1e3, "segments": auto_run.auto.segments,
               "switches": auto_run.auto.switches}
        for sync in (False, True):
            events = []
            with logged(events, sync):
                start = time.perf_counter()
                timed = run(True, repeat)
            row["synced" if sync else "logged"] = {
                "decode_s": timed.decode_s,
                "events": [(name, label, round((a - start) * 1e3, 3), round((b - a) * 1e3, 3))
                           for name, label, a, b in events]}
        result["rows"].append(row)
        common.write_json(path, result)
        print(f"repeat {repeat}: {plan.first.name} whole {row['whole_s']:.4f} s, auto {row['auto_s']:.4f} s, "
              f"gap {row['gap_ms']:.2f} ms", flush=True)
    last = result["rows"][-1]
    for kind in ("logged", "synced"):
        print(f"{kind} auto run ({last[kind]['decode_s']:.4f} s): name, program, start ms, duration ms")
        for event in last[kind]["events"]:
            print("  ", *event)
    print(common.markdown_table(result["rows"], TABLE))


if __name__ == "__main__":
    main()
