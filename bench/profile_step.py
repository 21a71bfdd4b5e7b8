"""Where an iteration's time goes: a device profile of each stage at Qwen3-8B, Qwen3-30B-A3B, gpt-oss-20b,
SmolLM2 (dense, or converted to NSA as `jaxspec.convert --to-nsa` does) or 1.2B Llama shapes.

    PYTHONPATH=. python3 bench/profile_step.py [--model qwen3-8b|qwen3-30b-a3b|gpt-oss-20b|smollm2|nsa-smollm2|llama-1b]
        [--methods plain,vegas]
        [--draft-weights exact,int8,int4] [--batch 1] [--context 4096] [--sampling greedy|sample] [--tiny]
        [--out DIR] [--name NAME] [--top 12] [--sequence 0] [--no-trace]
        [--stages iteration,draft,verify,select] [--live 128,32,4] [--balance 2] [--select-every 2]
        [--head-contexts full,selected] [--experts bf16|mxfp4|mxfp4-words|mxfp4-scale-words] [--groups 0,8,1] [--tree bfs:3,2]
        [--draws sampled,top] [--layers N]

For each method (and each --draft-weights kind of a model drafter) it builds the stages of `bench/throughput.py` (the loop iteration, draft, verify,
select; each a donating function of one decode state) and runs each under `jax.profiler`. Per stage:
wall time per call, GPU busy time (the union of kernel intervals), the number of kernels, and the top
kernels by device time. A stage whose wall time exceeds its busy time loses it to launch gaps or host
round trips; one whose kernels cost more than their bytes shows which (XLA names fusion kernels as in
the optimized HLO: `--xla_dump_to` to read them). `--sequence N` keeps the first N kernels of a stage's
first profiled call in launch order (name, us): one layer's chain of kernels, to see what to fuse.
`--tree bfs:3,2` drafts that tree (`bench/e2e.py`'s shapes) instead of a chain of --gamma with
the drafters that take one. `--live N,...` also times the iteration with only the first N rows unfinished (a static batch's
tail: finished rows stay in the batch until its last row is done). `--balance B` runs the sparse
drafters with a shared budget over rows that drafted unevenly well (`skewed`). Random bf16 weights
(timing only; the largest shapes, e.g. Qwen3-30B-A3B at 4 x 128K, need
XLA_PYTHON_CLIENT_MEM_FRACTION=0.97: JAX takes 75% of the GPU by default). `--sampling sample`
runs T 0.7, top-p 0.95 (the headline setting) in the draft stage and the iteration; `--draws sampled,top`
times the model drafters with each kind of draw (`SpecConfig.draws`). `--layers N` keeps the model's first N
layers (its sliding-window ones among them): a model whose whole depth does not fit the GPU beside its cache
(Qwen3-30B-A3B past 1 x 32K on an H100) is timed at two depths, and its whole step is the straight line through
them (a fit, reported as such: its layers are alike, so a step is a fixed part plus a layer's time per layer).
Writes DIR/NAME.json
(`--name`); prints a summary table last.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.throughput import spec_for, stage_fns
from jaxspec.models import decoder, draft_weights
from jaxspec.models.nsa_convert import DEFAULT_NSA, nsa_model_config
from jaxspec.decoding.tree import TreeShape
from jaxspec.decoding.spec import SCORE_METHODS, SPARSE_METHODS, takes_draft_model
from pallas_kernels.verify_attention import METRICS

CALLS = 4  # profiled calls per stage (after one warm-up call)


def device_events(trace_dir: str) -> dict[str, list]:
    """{line name: [(name, start_ns, duration_ns)]} of the first GPU plane in the trace (CPU: host)."""
    path = sorted(Path(trace_dir).rglob("*.xplane.pb"))[-1]
    data = jax.profiler.ProfileData.from_file(str(path))
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")] or [p for p in data.planes if p.name == "/host:CPU"]
    lines = collections.defaultdict(list)
    for line in planes[0].lines:
        for e in line.events:
            if e.duration_ns > 0:
                lines[line.name].append((e.name, e.start_ns, e.duration_ns))
    return lines


def busy_ns(events: list) -> float:
    """Length of the union of the events' intervals."""
    total, end = 0.0, -1.0
    for _, start, duration in sorted(events, key=lambda e: e[1]):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def top(events: list, calls: int, n: int) -> list[tuple[str, float, int]]:
    """The n kernels with the most time: (name, microseconds per call, count per call)."""
    time_ns, count = collections.Counter(), collections.Counter()
    for name, _, duration in events:
        time_ns[name] += duration
        count[name] += 1
    return [(n, t / calls / 1e3, count[n] // calls) for n, t in time_ns.most_common(n)]


def profile_stage(fn, state, calls: int, n_top: int, n_sequence: int, trace: bool = True, warmup: int = 1):
    """Times, then profiles, `calls` back-to-back calls of fn (after `warmup` calls, the first of them
    timed with its compile); returns (summary, state).

    The profiler changes what it measures (XLA runs without command buffers under it), so the wall
    time without it comes first; `trace=False` stops there (to compare XLA flags that the profiler
    would override)."""
    start = time.perf_counter()
    state = jax.block_until_ready(fn(state))
    first_call = time.perf_counter() - start  # compilation included
    warmup_ms = []  # each later warm-up call alone: XLA's first executions set up its command buffers
    for _ in range(warmup - 1):
        start = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        warmup_ms.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    for _ in range(calls):
        state = fn(state)
    jax.block_until_ready(state)
    unprofiled = (time.perf_counter() - start) / calls
    if not trace:
        return {"first_call_s": first_call, "warmup_ms": warmup_ms, "wall_ms": unprofiled * 1e3}, state
    with tempfile.TemporaryDirectory() as trace_dir:
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                state = fn(state)
            jax.block_until_ready(state)
        wall = (time.perf_counter() - start) / calls
        lines = device_events(trace_dir)
    kernels = [e for name, events in lines.items() if name.startswith(("Stream", "tf_XLA")) for e in events]  # GPU streams; CPU threads
    summary = {
        "first_call_s": first_call,
        "warmup_ms": warmup_ms,
        "wall_ms": unprofiled * 1e3,
        "wall_ms_profiled": wall * 1e3,
        "kernels_per_call": len(kernels) // calls,
        "busy_ms": busy_ns(kernels) / calls / 1e6,
        "top_kernels": top(kernels, calls, n_top),
        "lines": sorted(lines),
    }
    if n_sequence:
        ordered = sorted(kernels, key=lambda e: e[1])
        summary["sequence"] = [(name, round(duration / 1e3, 2)) for name, _, duration in ordered[:n_sequence]]
    return summary, state


def skewed(state, balance: float, iterations: int = 10_000):
    """The state with `iterations` past iterations per row, the rows' lost drafts per iteration spread
    log-uniformly over [1/balance, balance] times their mean (as if they drafted unevenly well), so a
    shared budget's selections differ in size as they do in a real batch. Random weights lose every
    draft, so each timed iteration adds depth lost drafts to every row: against 10,000 past
    iterations the shares barely move. Unchanged at balance 1."""
    if balance == 1:
        return state
    s = state.stats
    B, depth = s.accepted_by_depth.shape
    rate = 0.4 * np.exp(np.random.default_rng(0).uniform(-np.log(balance), np.log(balance), B))
    lost = np.minimum(np.round(rate * iterations), iterations * depth).astype(np.int32)
    stats = dataclasses.replace(s, iterations=jnp.full((B,), iterations, jnp.int32),
                                accepted=jnp.asarray(iterations * depth - lost))
    return dataclasses.replace(state, stats=stats)


def default_name(args, context: int) -> str:
    """The JSON's name from the settings that change what is timed."""
    experts = "" if args.experts == "bf16" else f"_{args.experts}"
    sampling = "" if args.sampling == "greedy" else f"_{args.sampling}"
    layers = "" if args.layers is None else f"_{args.layers}l"
    return f"profile_{args.model}{experts}{layers}_b{args.batch}_{context}{sampling}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b",
                   choices=("qwen3-8b", "qwen3-30b-a3b", "gpt-oss-20b", "smollm2", "nsa-smollm2", "llama-1b"))
    p.add_argument("--sampling", choices=tuple(common.SAMPLINGS), default="greedy")
    p.add_argument("--experts", choices=common.EXPERT_FORMS, default="bf16", help=common.EXPERT_FORMS_HELP)
    p.add_argument("--methods", default="plain,vegas", type=lambda s: s.split(","))
    p.add_argument("--draft-weights", default="exact", type=lambda s: s.split(","),
                   help="the draft weights of each model drafter: exact,int8,int4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--tree", default=None, help="a draft tree ('bfs:3,2') instead of a chain of --gamma")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--metric", choices=METRICS, default="weight", help="the score-collecting drafters' metric")
    p.add_argument("--backend", default="pallas" if jax.default_backend() == "gpu" else "reference")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU smoke test of this script")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--name", default=None, help="the JSON is DIR/NAME.json (default: profile_MODEL[_EXPERTS]"
                                                "_bBATCH_CONTEXT[_SAMPLING], so runs of other settings keep theirs)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per stage, most time first")
    p.add_argument("--sequence", type=int, default=0, help="kernels kept in launch order per stage")
    p.add_argument("--no-trace", action="store_true", help="wall times only, without the profiler")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before the timed ones")
    p.add_argument("--stages", default=None, type=lambda s: s.split(","),
                   help="only these stages (iteration, draft, verify, select); default all")
    p.add_argument("--groups", default=[0], type=lambda s: [int(n) for n in s.split(",")],
                   help="NSA models: the drafters' verification groups (adjacent draft rows per program), each run")
    p.add_argument("--draws", default=[None], type=lambda s: s.split(","),
                   help="model drafters' draws when sampling, comma-separated (SpecConfig.draws; default: "
                        "the method's)")
    p.add_argument("--head-contexts", default=["full"], type=lambda s: s.split(","),
                   help="eagle: the head's context, full and/or selected (--ratio of the context, as vegas selects)")
    p.add_argument("--balance", type=float, default=1.0,
                   help="sparse drafters share the budget (SpecConfig.balance); rows start with lost-draft rates spread log-uniformly over [1/B, B]")
    p.add_argument("--select-every", type=int, default=1,
                   help="score drafters select after every N-th verification (SpecConfig.select_every); "
                        "the iteration stage then times groups of N")
    p.add_argument("--live", default=[], type=lambda s: [int(n) for n in s.split(",")],
                   help="also time the iteration with only the first N rows unfinished, for each N")
    p.add_argument("--layers", type=int, default=None,
                   help="the model's first N layers only (a model too deep for the GPU, timed at two depths)")
    args = p.parse_args()

    from bench.decode import TINY_CFG

    models = {"qwen3-8b": common.QWEN3_8B, "qwen3-30b-a3b": common.QWEN3_30B_A3B, "gpt-oss-20b": common.GPT_OSS_20B,
              "smollm2": common.SMOLLM2, "nsa-smollm2": nsa_model_config(common.SMOLLM2, DEFAULT_NSA),
              "llama-1b": common.LLAMA_1B}
    cfg = TINY_CFG if args.tiny else models[args.model]
    if args.tiny and "eagle" in args.methods:  # an EAGLE-3 head reads three distinct layers: (2, L // 2, L - 3)
        cfg = dataclasses.replace(cfg, num_layers=8)
    sampling = common.SAMPLINGS[args.sampling]
    context = 256 if args.tiny else args.context
    if args.experts != "bf16" and cfg.moe is None:
        p.error(f"--experts {args.experts} needs an MoE model, not {args.model}")
    if args.layers is not None:
        if not 8 <= args.layers <= cfg.num_layers or cfg.nsa:  # an EAGLE-3 head reads layers 2, L // 2, L - 3
            p.error(f"--layers takes 8 to {cfg.num_layers} of a model without NSA, not {args.layers}")
        cfg = dataclasses.replace(cfg, num_layers=args.layers,
                                  sliding_layers=tuple(i for i in cfg.sliding_layers if i < args.layers))
    params = decoder.init_params(cfg, jax.random.key(0))
    if args.experts != "bf16":
        params = common.with_mxfp4_experts(params, args.experts)
    max_len, slots, k_max = common.random_lengths(context)
    result = common.run_info() | {
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": args.model, "layers": cfg.num_layers,
        "experts": args.experts, "sampling": args.sampling, "batch": args.batch, "context": context,
        "gamma": args.gamma, "tree": args.tree, "ratio": args.ratio, "metric": args.metric, "stages": []}
    tuning = {m: {"gamma": args.gamma, "ratio": args.ratio, "metric": args.metric} for m in args.methods}
    runs = [(m, w, c, g, d) for m in args.methods
            for w in (args.draft_weights if m not in ("plain", "ngram") else ["exact"])
            for c in (args.head_contexts if m == "eagle" else ["full"])
            for g in (args.groups if cfg.nsa and m != "plain" else [0])
            for d in (args.draws if m not in ("plain", "ngram") else [None]) if takes_draft_model(m, w)]
    head, head_params = common.random_head(cfg) if "eagle" in args.methods else (None, None)  # timing only
    for method, weights, head_context, group, draws in runs:
        spec = dataclasses.replace(spec_for(method, tuning, args.backend, k_max=k_max if method != "plain" else None,
                                            eagle=head if method == "eagle" else None),
                                   draft_weights=weights, head_context=head_context, group=group, draws=draws,
                                   balance=args.balance if method in SPARSE_METHODS else 1.0,
                                   select_every=args.select_every if method in SCORE_METHODS else 1)
        if args.tree and method != "plain":
            tree = TreeShape.parse(*reversed(args.tree.split(":")))
            spec = dataclasses.replace(spec, tree=tree.branching, traversal=tree.order).validate()
        copies = draft_weights.with_draft_weights(params, weights)
        if method == "eagle":
            copies = {**copies, "eagle": head_params}
        cache = common.random_cache(cfg, args.batch, slots, jax.random.key(1), head=spec.eagle)
        state = skewed(common.random_state(copies, cfg, spec, cache, context, max_len), spec.balance)
        stages, state = stage_fns(copies, cfg, spec, max_len, state, sampling)
        B = state.length.shape[0]
        timed = [(name, fn, per_call, None) for name, (fn, per_call) in stages.items()]
        timed += [("iteration_ms", *stages["iteration_ms"], live) for live in args.live]
        for name, fn, per_call, live in timed:
            if args.stages and name.removesuffix("_ms") not in args.stages:
                continue
            if live is not None:  # a fresh state (earlier calls moved its rows on), rows >= live finished
                del state
                state = common.random_state(copies, cfg, spec, common.random_cache(cfg, B, slots, jax.random.key(1),
                                                                                   head=spec.eagle), context, max_len)
                state = dataclasses.replace(skewed(state, spec.balance), done=jnp.arange(B) >= live)
            summary, state = profile_stage(fn, state, CALLS, args.top, args.sequence, trace=not args.no_trace,
                                           warmup=args.warmup)
            label = method + ("" if head_context == "full" else f" ({head_context} context)") + (
                f" draws {draws}" if draws else "")
            row = {"method": label + (f" group {group or 'auto'}" if cfg.nsa and method != "plain" else ""),
                   "draft_weights": weights, "stage": name.removesuffix("_ms") + ("" if live is None else f" live {live}"),
                   "iterations_per_call": per_call} | summary
            result["stages"].append(row)
            if args.no_trace:
                print(f"\n{row['method']} {weights} {row['stage']}: {summary['wall_ms']:.2f} ms/call wall")
                continue
            print(f"\n{row['method']} {weights} {row['stage']}: {summary['wall_ms']:.2f} ms/call wall "
                  f"({summary['wall_ms_profiled']:.2f} profiled), "
                  f"GPU busy {summary['busy_ms']:.2f} ms, {summary['kernels_per_call']} kernels/call; lines {summary['lines']}")
            for n, us, count in summary["top_kernels"]:
                print(f"  {us:9.1f} us  x{count:<5d} {n[:110]}")
        common.write_json(args.out / f"{args.name or default_name(args, context)}.json", result)
        del state, copies
    print(f"\nXLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    print("| method | draft weights | stage | iterations/call | wall ms/call | profiled ms/call | GPU busy ms/call | kernels/call | first call s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["stages"]:
        traced = [f"{r[k]:.2f}" if k in r else "-" for k in ("wall_ms_profiled", "busy_ms")] + [str(r.get("kernels_per_call", "-"))]
        print(f"| {r['method']} | {r['draft_weights']} | {r['stage']} | {r['iterations_per_call']} | {r['wall_ms']:.2f} | "
              + " | ".join(traced) + f" | {r['first_call_s']:.1f} |")


if __name__ == "__main__":
    main()
