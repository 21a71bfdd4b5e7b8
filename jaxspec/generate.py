"""`python -m jaxspec.generate`: batched generation from the command line, with speed and acceptance stats.

The default `--method auto` asks the planner (`jaxspec.planner`) which strategy pays for this model,
device, context and batch (plain decoding unless speculation is measured or predicted to be faster),
refines that choice over the first iterations and reports it. It chooses gamma, tree, ratio and
group itself, so those flags (and --tuned) need a fixed --method. `--precision` other than strict
allows approximate NSA verification, which is not lossless: it is announced on stderr and in the stats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import threading
from pathlib import Path

import jax

from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec import planner
from jaxspec.runner import (PROGRESS_SEGMENT, encode_prompts, gpu_unseen_warning, read_prompt, resolve_max_len,
                            run_generation, summarize)
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import (DRAWS, HEAD_CONTEXTS, METHODS, METRICS, PRECISIONS,
                                    SpecConfig, at_batch, load_tuned, spec_from_settings)
from jaxspec.decoding.tree import TreeShape
from jaxspec.calibrate_skip import resolve_skip
from jaxspec.models import draft_weights, sharding
from jaxspec.models.config import ModelConfig
from jaxspec.models.eagle import EagleConfig
from jaxspec.serving.requests import Request
from jaxspec.serving.scheduler import Scheduler
from jaxspec.xla_flags import set_gpu_flags

DEFAULT_PROMPT = "Explain in a few paragraphs why the sky is blue and why sunsets are red."


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --backend, --max-len, --tp (shared with `python -m jaxspec.serve`)."""
    gpu = jax.default_backend() == "gpu"
    p.add_argument("--model", default="smollm2", help="smollm2 | path to a .gguf file | HF directory | orbax checkpoint")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    p.add_argument("--backend", choices=("reference", "pallas"), default="pallas" if gpu else "reference")
    p.add_argument("--max-len", type=int, default=None, help="cap on prompt + generated tokens")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism over this many devices (heads, MLP columns and vocabulary split)")


def add_method_flags(p: argparse.ArgumentParser) -> None:
    """The decoding method and its settings (shared with `python -m jaxspec.serve`)."""
    p.add_argument("--method", choices=("auto", *METHODS), default="auto",
                   help="auto (default): the planner's choice for this model, device, context and batch")
    p.add_argument("--gamma", type=int, default=None, help="draft length of a chain (default 6, eagle 4, or the --tuned choice)")
    p.add_argument("--tree", default=None,
                   help="draft a tree instead of a chain: branching per depth, e.g. 4,2,1,1, or each node's children, "
                        "e.g. 5,3+1 (at most 64 verified rows)")
    p.add_argument("--traversal", choices=("bfs", "dfs"), default="bfs", help="flattening order of the --tree nodes")
    p.add_argument("--ratio", type=float, default=None, help="fraction of the context a sparse drafter keeps (default 0.07, or the --tuned choice)")
    p.add_argument("--tuned", type=Path, default=None,
                   help="a file from `python -m jaxspec.tune` (or bench/kv_bound.json): its gamma or tree, ratio and metric for --method")
    p.add_argument("--min-tokens", type=int, default=256, help="least KV entries a sparse drafter keeps")
    p.add_argument("--balance", type=float, default=None,
                   help="a sparse drafter's rows share the budget by their lost drafts, each within [1/B, B] of an even share "
                        "(default 1: even, or the --tuned choice)")
    p.add_argument("--metric", choices=METRICS, default=None, help="score of vegas/all_rows/last_accepted (default weight, or the --tuned choice)")
    p.add_argument("--select-every", type=int, default=None,
                   help="vegas/all_rows/last_accepted: select after every N-th verification only; the others collect no "
                        "scores and the drafts reuse the selection (default 1, or the --tuned choice)")
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--precision", choices=PRECISIONS, default="strict",
                   help="NSA verification precision class (only strict is lossless); with --method auto, the classes auto may use")
    p.add_argument("--group", type=int, default=None,
                   help="NSA models: adjacent draft rows verified per program (default 0: by the batch and draft rows)")
    p.add_argument("--draft-weights", choices=draft_weights.DRAFT_WEIGHTS, default=None,
                   help="layer weights draft steps read: exact (default), or int8 / int4 copies made at load (verification stays exact)")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="an EAGLE-3 draft head for --method eagle (and among auto's strategies): a directory in the "
                        "public layout (config.json, model.safetensors; python -m jaxspec.train_eagle builds one); "
                        "default: the head shipped for --model (checkpoints/eagle3-smollm2 for smollm2)")
    p.add_argument("--head-context", choices=HEAD_CONTEXTS, default=None,
                   help="--method eagle: the head attends its whole cache (full, default) or the slots the last "
                        "verification scored highest, as vegas selects them (--ratio, --min-tokens, --metric), plus the tail")
    p.add_argument("--draws", choices=DRAWS, default=None,
                   help="when sampling, a drafter's children: drawn from its distribution (sampled) or its top "
                        "tokens (top), verified as one-hot candidates; lossless either way, top iterates faster. "
                        "Default: top for an eagle tree, sampled for an eagle chain and the other drafters")
    p.add_argument("--draft-skip", default=None,
                   help="layers draft steps leave out: 3,5,10-12 | everyN | calibrated (python -m jaxspec.calibrate_skip) | a calibration file")
    p.add_argument("--planner-table", type=Path, default=None,
                   help="--method auto: a table from `python -m jaxspec.profile` (default: the shipped one for this model and device)")


def parse_args(argv):
    p = ArgumentParser(prog="python -m jaxspec.generate", description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", default=[], type=Path, help="a file holding one prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: when the model has one)")
    add_method_flags(p)
    p.add_argument("--shrink", action=argparse.BooleanOptionalAction, default=False,
                   help="as rows finish, decode the unfinished ones in a smaller batch: pays in long or repeated runs "
                        "(each smaller row count compiles once, ~4-7 s; at 128 rows it saved 0-6%% of vegas's decode "
                        "time and a quarter of stream's)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print one prompt's text as tokens are accepted (default: on a terminal, for one prompt without --json)")
    return p.parse_args(argv)


def spec_from_args(args, batch: int = 1) -> SpecConfig:
    """The validated SpecConfig of the method flags for a batch of `batch` rows (`--tuned` settings
    may differ per batch size; `--method auto`: plain, the planner's starting point, with the fixed
    settings refused: auto chooses them)."""
    auto = args.method == "auto"
    if auto:
        fixed = [flag for flag, value in (("--gamma", args.gamma), ("--tree", args.tree), ("--ratio", args.ratio),
                                          ("--group", args.group), ("--tuned", args.tuned), ("--balance", args.balance),
                                          ("--select-every", args.select_every), ("--draft-weights", args.draft_weights),
                                          ("--draft-skip", args.draft_skip), ("--head-context", args.head_context),
                                          ("--draws", args.draws))
                 if value is not None]
        if fixed:
            raise JaxspecError(f"--method auto chooses {', '.join(fixed)} itself; give a --method to fix them")
    elif args.planner_table:
        raise JaxspecError("--planner-table is for --method auto")
    tuned = at_batch(load_tuned(args.tuned, args.method), batch) if args.tuned else None
    head = head_config(args)  # checked before any weights load
    return spec_from_settings(
        "plain" if auto else args.method, tuned=tuned, gamma=args.gamma,
        tree=None if args.tree is None else TreeShape.parse(args.tree).branching, traversal=args.traversal, ratio=args.ratio,
        min_tokens=args.min_tokens, metric=args.metric, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        backend=args.backend, precision="strict" if auto else args.precision, group=args.group,
        draft_weights=args.draft_weights, balance=args.balance, select_every=args.select_every,
        eagle=None if auto else head,  # auto: the plan says whether it drafts with the head
        head_context=args.head_context, draws=args.draws,
    )


def head_path(args) -> Path | None:
    """The EAGLE-3 head of the run: --draft-model, or with --method eagle or auto the head shipped for
    --model (checkpoints/eagle3-smollm2 for smollm2), or None."""
    from jaxspec.loaders.eagle import shipped_head

    if args.draft_model is None and args.method in ("eagle", "auto"):
        return shipped_head(args.model)
    return args.draft_model


def head_config(args, cfg: ModelConfig | None = None) -> EagleConfig | None:
    """The head's config (`head_path`), checked against the model's config (`cfg`, read from --model
    if not given; None without a head)."""
    if args.draft_model is not None and args.method not in ("eagle", "auto"):
        raise JaxspecError(f"--draft-model is an EAGLE-3 head, which drafts with --method eagle (or auto), "
                           f"not {args.method}")
    path = head_path(args)
    if path is None:
        if args.method == "eagle":
            raise JaxspecError("--method eagle needs a draft head: --draft-model DIR (an EAGLE-3 checkpoint; "
                               "one ships for smollm2)")
        return None
    from jaxspec.loaders import load_config
    from jaxspec.loaders.eagle import read_config

    if not path.is_dir():
        raise JaxspecError(f"--draft-model {path} is not a directory (an EAGLE-3 head's)")
    return read_config(path, cfg or load_config(args.model, args.dtype))


def load(args, spec: SpecConfig):
    """(cfg, params, tokenizer, mesh): the model of --model at --dtype, split over --tp devices (mesh
    None for one), with the draft weights of `spec` (checked first: `check_draft`) and the EAGLE-3
    head of --draft-model under "eagle" (whole on every device)."""
    from jaxspec.loaders import load_model

    mesh = sharding.make_mesh(args.tp) if args.tp != 1 else None
    cfg, params, tokenizer = load_model(args.model, dtype=args.dtype, mesh=mesh)
    params = with_draft_model(params, spec.draft_weights, spec.draft_skip, mesh, cfg.expert_parallel)
    if spec.eagle is not None:
        params = with_head(params, args, cfg, mesh)
    return cfg, params, tokenizer, mesh


def with_head(params, args, cfg, mesh) -> dict:
    """`params` with the EAGLE-3 head of `head_path` under "eagle" (whole on every device)."""
    from jaxspec.loaders.eagle import load_eagle

    _, head = load_eagle(head_path(args), cfg, args.dtype)
    return {**params, "eagle": jax.device_put(head) if mesh is None else sharding.place({"eagle": head}, mesh)["eagle"]}


def plan_auto(args, spec: SpecConfig, cfg, params, mesh, **run) -> tuple[planner.Plan, SpecConfig, dict]:
    """--method auto: the plan for a run of `run` (`planner.make_plan`'s run arguments), with the head
    of `head_path`, if any, among its strategies; and the spec and params it starts with (the head's
    config and weights when the plan starts with eagle, the draft weights' copies its candidates need).
    A head the table did not measure where it measured another (for runs like this one) is no
    candidate: a note on stderr says how to profile it."""
    head = head_config(args, cfg)
    plan, spec = plan_with_head(cfg, planner.tree_bytes(params), spec, head, head and head_path(args),
                                precisions=planner.allowed_precisions(args.precision), table=args.planner_table,
                                min_tokens=args.min_tokens, **run)
    if plan.unmeasured_head:
        head_dir, table = head_path(args), plan.source.removeprefix("table:")
        command = shlex.join(["--model", str(args.model), "--eagle-cells", "--draft-model", str(head_dir),
                              "--out", table])
        print(f"note: {table} measured another draft head than {head_dir} for runs like this one, so auto plans "
              f"without it; measure it where the table measured another head: python -m jaxspec.profile {command}",
              file=sys.stderr)
    params = with_draft_model(params, plan.draft_weights, (), mesh, cfg.expert_parallel)
    if plan.first.method == "eagle":
        params = with_head(params, args, cfg, mesh)
    return plan, spec, params


def plan_with_head(cfg, weight_bytes: int, spec: SpecConfig, head: EagleConfig | None, head_dir: Path | None,
                   **run) -> tuple[planner.Plan, SpecConfig]:
    """`planner.make_plan` (`run`: its run arguments) with the EAGLE-3 head at `head_dir` (config
    `head`; None: no head) among its strategies, and the spec the plan starts with: `spec`, with the
    head's config when the plan starts with eagle."""
    from jaxspec.loaders.eagle import head_fingerprint

    plan = planner.make_plan(cfg, weight_bytes, head=head, head_id=head_dir and head_fingerprint(Path(head_dir)), **run)
    return plan, dataclasses.replace(spec, eagle=head) if plan.first.method == "eagle" else spec


def check_draft(args, spec: SpecConfig, precision: str | None = None) -> SpecConfig:
    """The spec with --draft-skip resolved for the model and checked against it (at `precision` if
    given: auto's allowed classes), from the model's config alone: a flag that does not fit the model
    fails before its weights load."""
    from jaxspec.loaders import load_config

    cfg = load_config(args.model, args.dtype)
    spec = dataclasses.replace(spec, draft_skip=resolve_skip(args.draft_skip, args.model, cfg.num_layers)).validate()
    dataclasses.replace(spec, precision=precision or spec.precision).check_model(cfg)
    return spec


def with_draft_model(params, kind: str, skip: tuple[int, ...], mesh, experts: bool = False) -> dict:
    """`draft_weights.with_draft_weights`, the copies split as the params are (`mesh`: tensor parallel;
    `experts`: `ModelConfig.expert_parallel`)."""
    if mesh is None:
        return draft_weights.with_draft_weights(params, kind, skip)
    return sharding.place(draft_weights.with_draft_weights(params, kind, skip, shards=mesh.size), mesh, experts)


def announce_precision(args) -> None:
    """Says on stderr that a --precision other than strict is not lossless."""
    if args.precision != "strict" and args.method == "auto":
        print(f"precision {args.precision} allowed: auto may choose strategies that are NOT lossless; the output "
              "distribution may differ from the model's (the stats say which ran)", file=sys.stderr)
    elif args.precision != "strict":
        print(f"precision {args.precision}: NOT lossless; the output distribution differs from the model's", file=sys.stderr)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        raise JaxspecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    auto = args.method == "auto"
    prompts = list(args.prompt) + [read_prompt(path) for path in args.prompt_file]
    prompts = prompts or [DEFAULT_PROMPT]
    spec = spec_from_args(args, batch=len(prompts))
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    stream = (sys.stdout.isatty() and len(prompts) == 1 and not args.json) if args.stream is None else args.stream
    if stream and (len(prompts) > 1 or args.json):  # before loading the model: a flag error is instant
        raise JaxspecError("--stream prints one prompt's text as it is generated: give one prompt and no --json")

    if warning := gpu_unseen_warning():
        print(warning, file=sys.stderr)
    spec = check_draft(args, spec, precision=args.precision)  # auto: the classes it may use
    cfg, params, tokenizer, mesh = load(args, spec)
    announce_precision(args)
    chat = tokenizer.has_chat_template if args.chat is None else args.chat
    if chat and not tokenizer.has_chat_template:
        raise JaxspecError(f"--chat: model {args.model} has no chat template")
    batch = encode_prompts(tokenizer, prompts, chat)
    max_len = resolve_max_len(batch, args.max_new_tokens, args.max_len, cfg.max_position_embeddings)
    plan = None
    if auto:
        plan, spec, params = plan_auto(args, spec, cfg, params, mesh, batch=len(batch.lengths),
                                       prompt_tokens=int(batch.lengths.max()), sampling=sampling,
                                       new_tokens=min(args.max_new_tokens, max_len - int(batch.lengths.max())))
    if stream:
        return _stream(params, cfg, tokenizer, spec, plan, batch, sampling, max_len, args, mesh)
    common = dict(sampling=sampling, max_len=max_len, max_new_tokens=args.max_new_tokens,
                  stop_ids=tokenizer.eos_token_ids, seed=args.seed, progress=progress, mesh=mesh, shrink=args.shrink)
    run = run_generation(params, cfg, batch, spec=spec, plan=plan, **common)
    spec = run.auto.spec if auto else spec
    stats = {**summarize(run, batch, spec), "draft_weight_bytes": draft_weights.draft_bytes(params), "tp": args.tp}
    results = [
        {"prompt_tokens": int(n), "tokens": [int(t) for t in g], "text": tokenizer.decode(g, skip_special_tokens=True)}
        for n, g in zip(batch.lengths, run.generated())
    ]
    if args.json:
        print(json.dumps({"model": args.model, "results": results, "stats": stats}))
    else:
        _print_human(results, stats)


def _stream(params, cfg, tokenizer, spec: SpecConfig, plan, batch, sampling: SamplingConfig, max_len: int, args,
            mesh) -> None:
    """One prompt through the serving scheduler (one slot): its text printed as tokens are accepted,
    then the request's stats. `--method auto` refines the plan as the batch path does."""
    ids = tuple(int(t) for t in batch.ids[0, : batch.lengths[0]])
    scheduler = Scheduler(params, cfg, tokenizer, spec, slots=1, max_len=max_len, sampling=sampling, plan=plan, mesh=mesh,
                          segment=PROGRESS_SEGMENT)
    scheduler.warm_up(len(ids))
    scheduler.start()
    finished, last = threading.Event(), []

    def show(delta) -> None:
        print(delta.text, end="", flush=True)
        if delta.finish_reason is not None:
            last.append(delta)
            finished.set()

    scheduler.submit(Request(ids, min(args.max_new_tokens, max_len - len(ids)), sampling, args.seed), show)
    finished.wait()
    scheduler.stop()
    delta = last[0]
    if delta.error:
        raise JaxspecError(f"generation failed: {delta.error}")
    s = delta.stats
    decode_s = max(s.total_s - s.first_token_s, 1e-9)
    print("\n\n--- stats ---")
    print(f"prompt tokens    {s.prompt_tokens}")
    print(f"generated tokens {s.completion_tokens} ({delta.finish_reason})")
    print(f"first token      {s.first_token_s:.2f} s; then {max(s.completion_tokens - 1, 0) / decode_s:.1f} tok/s "
          "(compile time not included)")
    spec = scheduler.spec
    print(f"method           {spec.method} (backend {spec.backend}, device {jax.devices()[0].device_kind}; streamed)")
    if s.iterations and spec.method != "plain":
        print(f"iterations       {s.iterations}, {(s.accepted + s.iterations) / s.iterations:.2f} tokens/iteration")


def _print_human(results: list[dict], stats: dict) -> None:
    for i, r in enumerate(results):
        if len(results) > 1:
            print(f"=== [{i}] ===")
        print(r["text"])
    print("\n--- stats ---")
    print(f"prompt tokens    {stats['prompt_tokens']}  (batch {stats['batch']})")
    print(f"generated tokens {stats['generated_tokens']}")
    print(f"prefill          {stats['prefill_tokens_per_s']:.1f} tok/s ({stats['prefill_s']:.2f} s)")
    print(f"decode           {stats['decode_tokens_per_s']:.1f} tok/s ({stats['decode_s']:.2f} s)")
    print(f"compile          {stats['compile_s']:.1f} s, first calls {stats['load_s'] * 1e3:.0f} ms "
          "(not in the rates above)")
    memory = next(k for k in stats if k.startswith("peak_"))
    print(f"{memory.removesuffix('_bytes').replace('_', ' '):16} {stats[memory] / 2**20:.0f} MiB")
    print(f"method           {stats['method']} (backend {stats['backend']}, device {stats['device']})")
    if stats["method_requested"] == "auto":
        planned = stats["planned"]
        print(f"strategy         {stats['strategy']['name']} (auto; planned {planned['strategy']} from {planned['source']}, "
              f"bucket {planned['bucket']})")
        for s in stats["switches"]:
            print(f"switch           at iteration {s['iteration']}: {s['from']} -> {s['to']} ({s['reason']})")
    if not stats["lossless"]:
        print(f"precision        {stats['precision']}: NOT lossless")
    if stats["gamma"]:
        drafts = f"tree {stats['tree']} ({stats['traversal']})" if stats["tree"] else f"gamma {stats['gamma']}"
        print(f"drafts           {drafts}, {stats['nodes']} nodes" + (f", ratio {stats['ratio']}" if stats["ratio"] else "")
              + (f", metric {stats['metric']}" if stats["metric"] else "")
              + (f", {stats['draft_weights']} weights" if stats["draft_weights"] != "exact" else "")
              + (f", skipping layers {','.join(map(str, stats['draft_skip']))}" if stats["draft_skip"] else "")
              + (f" (+{stats['draft_weight_bytes'] / 2**20:.0f} MiB)" if stats["draft_weight_bytes"] else ""))
        print(f"iterations       {stats['iterations']}, {stats['tokens_per_iteration']:.2f} tokens/iteration")
        rates = " ".join(f"{r:.2f}" for r in stats["acceptance_rate_by_depth"])
        print(f"acceptance       {stats['accepted_tokens']} of {stats['draft_tokens']} nodes verified; by depth {rates}")


if __name__ == "__main__":
    set_gpu_flags()
    main()
