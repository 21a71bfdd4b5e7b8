"""`python -m jaxspec.profile`: measure the planner's lookup table for a model on this device.

Why: the planner (`jaxspec.planner`) picks a strategy from measurements where it has them, because
what pays depends on the model, the device, the context, the batch and the sampling mode far more
than a cost model can say (small models' steps run far above their bytes floors: bench/NOTES.md,
"Draft trees"). This runs
the real decode loop over the strategy space and writes the ranked table that `--method auto` reads.

    python -m jaxspec.profile --model smollm2 [--buckets 1024,2048,4096,8000] [--batch 1]
        [--samplings greedy,sample] [--methods plain,vegas,stream,ngram] [--gammas 2,4,6]
        [--trees 3,2,1 dfs:2,2,2] [--ratios 0.03,0.07] [--groups 1,4,8,16] [--precisions strict]
        [--draft-weights exact,int8] [--select-every 1,2] [--balances 1,2] [--draft-model DIR] [--new 256] [--repeats 3]
        [--prompts documents|requests] [--budget SECONDS] [--add] [--out FILE]
    python -m jaxspec.profile --model smollm2 --eagle-cells [--draft-model DIR] [--budget SECONDS] [--out FILE]

For every sampling mode (greedy first, as generate's default; then T 0.7 top-p 0.95, the headline
setting), batch size and context bucket: `--repeats` calibration batches of real text (jaxspec.corpus
documents from CALIBRATION_OFFSET on, which bench/planner.py's held-out prompts never reach; a
different document per row; chat template), each about bucket - new tokens long so the run ends
inside the bucket (`--prompts requests`: `corpus.REQUESTS`, short chat requests with no document,
whose cells are their own: a run takes the cells whose prompts are nearest its own prompt's length,
so a chat request is not planned from document rates, nor a document from chat ones), prefilled
once; then plain and every strategy of the space decode `--new` tokens from a copy of its cache
(seed = repeat; each strategy's first run untimed, `runner.timed_runs`), and the entry is the median
decode tokens/s over the batches with its spread. One batch's cache is held at a time, with a copy per
run (large batches at long contexts may need XLA_PYTHON_CLIENT_MEM_FRACTION=0.95: docs/development.md).
Dense models: plain and each method x (chain of each gamma, each tree) x ratio (sparse methods) x
draft weights (model drafters; `full` only with quantized ones) x `--select-every` (score methods) x
`--balances` (sparse methods: the rows share the budget, `SpecConfig.balance`).
Method eagle drafts with the EAGLE-3 head of `--draft-model` (default: the head shipped for the
model); its entries record the head's fingerprint, and a run with another head does not use them.
NSA models: the same x verification group x precision class (classes other than strict only when
listed, reuse ones only with a calibrated refresh schedule); each class gets its own ranked cell.

Compiles: one max_len (the largest bucket's prompts + new tokens), one padded prompt width and one
selection capacity per balance for the whole profile, so each strategy compiles once per sampling
mode and the buckets and ratios share it. `--budget` stops starting buckets, a bucket's later calibration batches
and its first batch's speculative measurements after that many seconds of measuring (a started
bucket still measures plain; a later batch runs every strategy the first ran, so entries share their
batches); the table is rewritten (atomically) after every cell, so a cut-off run keeps what it
measured, and cells already in `--out` for other (batch, sampling, bucket, precision) are kept; each
cell records how it was measured (new tokens, repeats, date, command), since the header describes
the latest run only. A cell measured again is replaced whole, unless `--add`: then it keeps its entries
for what this run does not measure, each stamped with its own run's record (`measured`), as when a new
draft head is profiled with `--methods plain,eagle` (plain is measured again with the head; a kept
entry is from another process, which on one device kind agrees within a few percent, under the
planner's 10% margin; a cell the budget cut before every strategy ran on every calibration batch is
not written: it keeps its own, and what it lacks is measured again by the next run).
`--eagle-cells` does that for every cell of the table that ranks another
head's eagle strategies without this head's: each with its own batch, bucket, sampling, prompts, new
tokens and repeats, and the eagle shapes it ranks (one run per batch and sampling, in one process), so
a new head answers wherever the head it replaces did; cells done are skipped, so a run cut short goes
on where it stopped. The default file is the shipped table of this model and device kind
(`jaxspec/planner/tables/`), which auto finds. A markdown summary is printed last.
"""

from __future__ import annotations

import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import corpus
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.tree import branching_text
from jaxspec.decoding.spec import METHODS, PRECISIONS, SCORE_METHODS, SPARSE_METHODS, SpecConfig, spec_from_settings, takes_draft_model
from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec.models import draft_weights
from jaxspec.planner import tables
from jaxspec.planner.strategy import Strategy
from jaxspec.runner import Batch, encode_prompts, prefill_fn, run_generation, summarize, timed_runs
from jaxspec.tune import parse_tree
from jaxspec.xla_flags import set_gpu_flags

CALIBRATION_OFFSET = 40  # first jaxspec.corpus document of the calibration prompts
TASKS = ("continue", "question", "summary")  # row r of a calibration batch asks TASKS[r % 3]


def strategy_space(cfg, methods, gammas, trees, ratios, groups, precisions, weights=("exact",),
                   select_every=(1,), balances=(1.0,)) -> list[Strategy]:
    """Plain (one per precision class) first, then every method x draft shape x ratio (sparse
    methods) x draft weights (model drafters; full only with quantized ones) x selection spacing
    (score methods) x balance (sparse methods), on NSA models also x group x precision class. Dense
    models verify exactly: one class (strict), group unused."""
    if cfg.nsa is None:
        groups, precisions = (0,), ("strict",)
    space = [Strategy(precision=p) for p in precisions]
    shapes = [dict(gamma=g) for g in gammas] + [dict(tree=t.branching, traversal=t.order) for t in trees]
    for method in methods:
        if method == "plain":
            continue
        kinds = ["exact"] if method == "ngram" else [w for w in weights if takes_draft_model(method, w)]
        for shape in shapes:
            for ratio in ratios if method in SPARSE_METHODS else (None,):
                for group in groups:
                    for precision in precisions:
                        for kind in kinds:
                            for every in select_every if method in SCORE_METHODS else (1,):
                                for balance in balances if method in SPARSE_METHODS else (1.0,):
                                    space.append(Strategy(method, ratio=ratio, precision=precision, group=group,
                                                          draft_weights=kind, select_every=every, balance=balance,
                                                          **shape))
    return space


def calibration_batch(tokenizer, chat: bool, batch: int, tokens: int, repeat: int,
                      prompts: str = tables.DOCUMENTS) -> Batch:
    """`batch` prompts of at most `tokens` tokens (chat template included), repeat r's rows taking the
    documents after repeat r - 1's; with `prompts` "requests", `corpus.REQUESTS` in turn instead (short
    chat requests, whatever `tokens`: a bucket that cannot hold one is an error)."""
    if prompts == "requests":
        rows = [corpus.REQUESTS[(repeat * batch + row) % len(corpus.REQUESTS)] for row in range(batch)]
        encoded = encode_prompts(tokenizer, rows, chat)
        if encoded.lengths.max() > tokens:
            raise JaxspecError(f"a bucket of {tokens} prompt tokens is too small for the calibration requests")
        return encoded
    overhead = int(encode_prompts(tokenizer, ["x"], chat).lengths[0]) - len(tokenizer.encode("x")) + 2
    if tokens - overhead < 16:
        raise JaxspecError(f"a bucket of {tokens} prompt tokens is too small for the calibration prompts")
    offsets = [CALIBRATION_OFFSET + 3 * (repeat * batch + row) for row in range(batch)]
    prompts = [corpus.long_prompt(tokenizer, tokens - overhead, task=TASKS[row % 3], offset=offset)
               for row, offset in enumerate(offsets)]
    return encode_prompts(tokenizer, prompts, chat)


def padded(batch: Batch, width: int) -> Batch:
    """The batch's ids right-padded to `width` columns (one prompt shape: one compilation)."""
    return Batch(np.pad(batch.ids, ((0, 0), (0, width - batch.ids.shape[1]))), batch.lengths)


def run_once(params, cfg, batch: Batch, cache, spec: SpecConfig, sampling, max_len: int, new: int, seed: int) -> tuple:
    """(decode tokens/s, tokens per iteration, iteration seconds, compile seconds) of one strategy
    decoding `new` tokens from a copy of a calibration batch's prefilled cache."""
    run = run_generation(params, cfg, batch, spec=spec, sampling=sampling, max_len=max_len, max_new_tokens=new,
                         stop_ids=(), seed=seed, cache=jax.tree.map(jnp.copy, cache))
    stats = summarize(run, batch, spec)
    loops = max(int(np.max(jax.device_get(run.output.stats.iterations))), 1)
    return stats["decode_tokens_per_s"], stats["tokens_per_iteration"], run.decode_s / loops, run.compile_s


def entry(runs: list[tuple]) -> dict:
    """One table entry from a strategy's runs (one per calibration batch): the median tokens/s, its
    spread, and medians of tokens per iteration and iteration time."""
    tps, tpi, its, compile_s = zip(*runs)
    return {"tokens_per_s": statistics.median(tps), "spread_tokens_per_s": max(tps) - min(tps),
            "tokens_per_iteration": statistics.median(tpi), "iteration_s": statistics.median(its), "runs": len(runs),
            "compile_s": sum(compile_s)}


def parse_args(argv):
    ints = lambda s: tuple(int(x) for x in s.split(","))
    floats = lambda s: tuple(float(x) for x in s.split(","))
    words = lambda s: tuple(s.split(","))
    gpu = jax.default_backend() == "gpu"
    p = ArgumentParser(prog="python -m jaxspec.profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--buckets", type=ints, default=(1024, 2048, 4096, 8000), help="context buckets (prompt + new tokens)")
    p.add_argument("--batch", type=ints, default=(1,), help="batch sizes, e.g. 1,8")
    p.add_argument("--samplings", type=words, default=("greedy", "sample"), help="greedy and/or sample")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sample mode")
    p.add_argument("--top-p", type=float, default=0.95, help="of the sample mode")
    p.add_argument("--methods", type=words, default=("plain", "vegas", "stream", "ngram"))
    p.add_argument("--gammas", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=(2, 4, 6),
                   help="eagle and the model drafters' chains (empty: --trees alone)")
    p.add_argument("--trees", nargs="*", default=["3,2,1", "dfs:2,2,2"], metavar="SHAPE",
                   help="e.g. 3,2,1 dfs:2,2,2 5,3+1 (each node its own children)")
    p.add_argument("--ratios", type=floats, default=(0.03, 0.07))
    p.add_argument("--groups", type=ints, default=(1, 4, 8, 16), help="NSA models: verification groups")
    p.add_argument("--precisions", type=words, default=("strict",), help="NSA models: precision classes to profile")
    p.add_argument("--draft-weights", type=words, default=("exact",),
                   help="the model drafters' draft weights to profile, e.g. exact,int8 (one quantized kind)")
    p.add_argument("--select-every", type=ints, default=(1,),
                   help="score methods (vegas, all_rows, last_accepted): select after every N-th verification, e.g. 1,2")
    p.add_argument("--balances", type=floats, default=(1.0,),
                   help="sparse methods: the largest share of the budget a row may take (SpecConfig.balance), e.g. 1,2")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="the EAGLE-3 head of --methods eagle (default: the head shipped for --model); its entries "
                        "record it, and answer only for runs with that head")
    p.add_argument("--prompts", choices=tables.PROMPT_KINDS, default=tables.DOCUMENTS,
                   help="calibration prompts: documents and a task, sized to the bucket, or short chat requests "
                        "(their own cells: a run takes the cells whose prompts are nearest its prompt's length)")
    p.add_argument("--new", type=int, default=256,
                   help="new tokens per measurement (generate's default run; 48 understates speculation, bench/NOTES.md)")
    p.add_argument("--repeats", type=int, default=3, help="calibration batches per bucket (median and spread)")
    p.add_argument("--budget", type=float, default=None, help="seconds of measuring; no measurement starts after them")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    p.add_argument("--backend", choices=("reference", "pallas"), default="pallas" if gpu else "reference")
    p.add_argument("--add", action="store_true",
                   help="a cell measured again keeps its entries for the strategies (and eagle heads) this run does "
                        "not measure, each recording its own run: profile a new draft head with --methods plain,eagle")
    p.add_argument("--eagle-cells", action="store_true",
                   help="measure plain and eagle with --draft-model in every cell of --out that ranks another "
                        "head's eagle strategies without its own, with each cell's own settings (implies --add)")
    p.add_argument("--replace", action="store_true",
                   help="with --add or --eagle-cells: a cell measured drops every other head's eagle entries (the "
                        "head replaces the one the table measured, e.g. a new shipped head)")
    p.add_argument("--out", type=Path, default=None, help="default: the shipped table of this model and device")
    return p.parse_args(argv)


# The flags of the grid a run measures: --eagle-cells takes them from the table's cells instead.
GRID = ("buckets", "batch", "samplings", "methods", "gammas", "trees", "ratios", "groups", "precisions",
        "draft_weights", "select_every", "balances", "prompts", "new", "repeats")


def eagle_cell_runs(table: dict, head_id: str) -> list[list[str]]:
    """The grid flags of the runs that measure plain and eagle with the head `head_id` in each cell of
    `table` that ranks another head's eagle strategies without this head's: one run per (sampling, batch,
    precision, new tokens, repeats, prompts), over its cells' buckets and the eagle shapes (and NSA
    groups) they rank, so a run measures just those cells. Chat-request cells come first (what a chat
    user's default run is planned from), then by batch size."""
    eagle = lambda cell, mine: {Strategy.from_json(e["strategy"]) for e in cell["ranked"]
                                if e["strategy"]["method"] == "eagle" and (e.get("head") == head_id) == mine}
    groups = {}
    for cell in table["cells"]:
        if eagle(cell, False) - eagle(cell, True):
            measured = tables.provenance(table, cell)
            key = (cell["sampling"], cell["batch"], cell["precision"], measured["new_tokens"], measured["repeats"],
                   tables.prompt_kind(cell))
            groups.setdefault(key, []).append(cell)
    runs = []
    first = lambda item: (item[0][5] != "requests", item[0][1], str(item[0]))
    for (sampling, batch, precision, new, repeats, prompts), cells in sorted(groups.items(), key=first):
        shapes = set().union(*(eagle(c, False) for c in cells))
        gammas = sorted({s.gamma for s in shapes if s.tree is None})
        trees = sorted({f"{s.traversal}:{branching_text(s.tree)}" for s in shapes if s.tree is not None})
        nsa_groups = sorted({s.group for s in shapes if s.group})
        flags = ["--methods", "plain,eagle", "--samplings", sampling, "--batch", str(batch),
                 "--buckets", ",".join(str(c["bucket"]) for c in sorted(cells, key=lambda c: c["bucket"])),
                 "--precisions", "strict" if precision == "strict" else f"strict,{precision}",
                 "--new", str(new), "--repeats", str(repeats), "--prompts", prompts,
                 "--gammas", ",".join(map(str, gammas)), "--trees", *trees]
        runs.append(flags + (["--groups", ",".join(map(str, nsa_groups))] if nsa_groups else []))
    return runs


def check_listed(flag: str, values: tuple, field: str, methods, takers, what: str) -> None:
    """A list option of a SpecConfig field: each value valid, none twice, and other than the default
    1 only with a method that takes it."""
    for value in values:
        spec_from_settings("vegas", **{field: value})
    if len(set(values)) < len(values):
        raise JaxspecError(f"{flag} lists a value twice: {','.join(map(str, values))}")
    if values != (1,) and not set(methods) & set(takers):
        raise JaxspecError(f"{flag} {what} {', '.join(takers)}; --methods has none")


def check_args(args) -> None:
    for method in args.methods:
        if method not in METHODS:
            raise JaxspecError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    for sampling in args.samplings:
        if sampling not in ("greedy", "sample"):
            raise JaxspecError(f"--samplings takes greedy and/or sample, got {sampling!r}")
    for precision in args.precisions:
        if precision not in PRECISIONS:
            raise JaxspecError(f"--precisions takes {', '.join(PRECISIONS)}, got {precision!r}")
    for kind in args.draft_weights:
        spec_from_settings("vegas", draft_weights=kind)
    if len(set(args.draft_weights) - {"exact"}) > 1:
        raise JaxspecError("--draft-weights: profile exact and at most one quantized kind (a plan uses one kind of copies)")
    if "strict" not in args.precisions:
        raise JaxspecError("--precisions must include strict (the lossless class every table ranks)")
    for gamma in args.gammas:
        spec_from_settings("vegas", gamma=gamma)
    for ratio in args.ratios:
        spec_from_settings(ratio=ratio)
    for group in args.groups:
        spec_from_settings(group=group)
    check_listed("--select-every", args.select_every, "select_every", args.methods, SCORE_METHODS,
                 "spaces the selections of")
    check_listed("--balances", args.balances, "balance", args.methods, SPARSE_METHODS, "shares the budget of")
    if args.new < 2 or args.repeats < 1 or min(args.batch) < 1 or min(args.buckets) < 1:
        raise JaxspecError("need --new >= 2, --repeats >= 1 and positive --batch and --buckets")
    if args.replace and not (args.eagle_cells or args.add and "eagle" in args.methods):
        raise JaxspecError("--replace needs --eagle-cells, or --add with --methods eagle: it drops other heads' "
                           "eagle entries from the cells those measure")
    if args.budget is not None and not args.budget > 0:  # (NaN too)
        raise JaxspecError(f"--budget must be a positive number of seconds, got {args.budget}")


@cli_main
def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    check_args(args)
    if args.eagle_cells:
        defaults = parse_args([])
        given = [name for name in GRID if getattr(args, name) != getattr(defaults, name)]
        if given:
            raise JaxspecError(f"--eagle-cells takes each cell's settings from the table: drop "
                               f"--{given[0].replace('_', '-')}")

    from jaxspec.loaders import load_model
    from jaxspec.loaders.eagle import head_fingerprint, load_eagle, shipped_head

    eagle = "eagle" in args.methods or args.eagle_cells
    head_dir = (args.draft_model or shipped_head(args.model)) if eagle else None
    if eagle and head_dir is None:
        raise JaxspecError(f"--methods eagle needs a draft head: --draft-model DIR (none ships for {args.model})")
    cfg, params, tokenizer = load_model(args.model, dtype=args.dtype)
    head, head_id = None, None
    if head_dir is not None:  # every strategy's cache then carries the head's: one prefill serves them all
        head, weights = load_eagle(head_dir, cfg, args.dtype)
        params = {**params, "eagle": jax.device_put(weights)}
        head_id = head_fingerprint(Path(head_dir))
    out = args.out or tables.table_path(cfg, tables.device_kind())
    started = time.monotonic()
    out_of_time = lambda: args.budget is not None and time.monotonic() - started > args.budget
    measure = lambda run_args, command: profile_grid(run_args, command, cfg, params, tokenizer, head, head_id, out,
                                                     out_of_time)
    if not args.eagle_cells:
        measured = measure(args, argv)
    else:
        if not out.is_file():
            raise JaxspecError(f"--eagle-cells: no table at {out} to take the cells from")
        table = tables.load_table(out)
        if table["model"]["fingerprint"] != tables.fingerprint(cfg) or table["device"] != tables.device_kind():
            raise JaxspecError(f"--eagle-cells: {out} is a table of {table['model']['fingerprint']} on "
                               f"{table['device']}, not of this model ({tables.fingerprint(cfg)}) on this device "
                               f"({tables.device_kind()})")
        runs = eagle_cell_runs(table, head_id)
        if not runs:
            print(f"no cell of {out} ranks another head's eagle entries without this head's: nothing to measure")
            return
        common = ["--model", args.model, "--dtype", args.dtype, "--backend", args.backend, "--temperature",
                  str(args.temperature), "--top-p", str(args.top_p), "--draft-model", str(head_dir), "--add",
                  "--out", str(out)] + (["--replace"] if args.replace else [])
        print(f"--eagle-cells: runs to make for the head {head_id}: {len(runs)} (one per batch and sampling mode)",
              flush=True)
        measured = []
        for flags in runs:
            if out_of_time():
                break
            run_args = parse_args(common + flags)
            check_args(run_args)
            measured += measure(run_args, common + flags)
    if not measured:
        raise JaxspecError("the budget ran out before a cell was measured; nothing written")
    if out_of_time():
        print(f"budget of {args.budget:.0f} s spent: stopped early", file=sys.stderr)
    print(f"\nsaved {len(measured)} cells to {out}\n")
    print(summary(measured))


def profile_grid(args, argv: list[str], cfg, params, tokenizer, head, head_id, out: Path, out_of_time) -> list[dict]:
    """Measures the grid of `args` (the flags `argv`, recorded in each cell) with the loaded model and
    head, writing each cell into the table at `out` as it is done; returns the cells measured."""
    trees = [parse_tree(text) for text in args.trees]
    samplings = {"greedy": SamplingConfig(), "sample": SamplingConfig(temperature=args.temperature, top_p=args.top_p)}
    precisions = []
    for p in args.precisions:
        if p.endswith("reuse") and (cfg.nsa is None or not cfg.nsa.refresh_layers):
            print(f"skipping precision {p}: the model has no calibrated refresh/reuse schedule", file=sys.stderr)
            continue
        spec_from_settings(precision=p).check_model(cfg)
        precisions.append(p)
    space = strategy_space(cfg, args.methods, args.gammas, trees, args.ratios, args.groups, precisions, args.draft_weights,
                           args.select_every, args.balances)
    params = draft_weights.with_draft_weights(params, next((w for w in args.draft_weights if w != "exact"), "exact"))
    chat = tokenizer.has_chat_template
    prompts = {(b, bucket, r): calibration_batch(tokenizer, chat, b, bucket - args.new, r, args.prompts)
               for b in args.batch for bucket in args.buckets for r in range(args.repeats)}
    width = max(x.ids.shape[1] for x in prompts.values())
    max_len = width + args.new
    if max_len > cfg.max_position_embeddings:
        raise JaxspecError(f"the largest bucket needs {max_len} positions; the model has {cfg.max_position_embeddings}")
    capacity = lambda b: spec_from_settings("vegas", ratio=max(args.ratios), balance=b).capacity(max_len)
    bases = {b: spec_from_settings(backend=args.backend, k_max=capacity(b), eagle=head)
             for b in args.balances}  # a shared budget's rows take up to `balance` times the even share
    base = bases[min(args.balances)]

    device = tables.device_kind()
    profile = {"new_tokens": args.new, "repeats": args.repeats, "max_len": max_len, "dtype": args.dtype,
               "samplings": {k: vars(samplings[k]) for k in args.samplings},
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": f"python -m jaxspec.profile {shlex.join(argv)}"}  # a command a shell runs again
    table = tables.new_table(cfg, args.model, device, args.backend, profile)
    if out.is_file():
        old = tables.load_table(out)
        if old["model"]["fingerprint"] == table["model"]["fingerprint"] and old["device"] == device:
            # the header describes this run alone: a kept cell keeps how it was measured (older tables
            # held that in their header only)
            table["cells"] = [{**tables.provenance(old, cell), **cell} for cell in old["cells"]]
    print(f"{len(space)} strategies x {len(args.buckets)} buckets x {len(args.batch)} batch sizes x "
          f"{len(args.samplings)} sampling modes, {args.repeats} calibration batches each; max_len {max_len}", flush=True)

    measured = []
    for mode in args.samplings:
        for b in args.batch:
            for bucket in args.buckets:
                if out_of_time():
                    break
                batches = [padded(prompts[b, bucket, r], width) for r in range(args.repeats)]
                prefill = prefill_fn(cfg, max_len, args.backend, base.prefill_chunk, head)
                runs = {}  # strategy: its runs, one per calibration batch so far
                for seed, x in enumerate(batches):  # one batch's cache at a time: held, and copied per run
                    if seed and out_of_time():  # later batches run every strategy of the first, or none
                        break
                    cache = prefill(params, jnp.asarray(x.ids), jnp.asarray(x.lengths))
                    for strategy in space if seed == 0 else list(runs):
                        if seed == 0 and out_of_time() and not strategy.plain:  # a started bucket gets plain
                            break
                        spec = strategy.spec(bases.get(strategy.balance or 1.0, base))
                        measure = lambda s, c=cache, spec=spec: run_once(
                            params, cfg, x, c, spec, samplings[mode], max_len, args.new, s)
                        if seed == 0:  # the strategy's first run is untimed (`runner.timed_runs`); its compile counts
                            first, (timed,) = timed_runs(measure, [seed])
                            timed = (*timed[:3], first[3])
                        else:
                            timed = measure(seed)
                        runs.setdefault(strategy, []).append(timed)
                    del cache
                entries = {p: [] for p in precisions}
                for strategy, rows in runs.items():
                    row = entry(rows)
                    measured_with = {"head": head_id} if strategy.method == "eagle" else {}
                    entries[strategy.precision].append({"strategy": strategy.to_json(), "name": strategy.name,
                                                        **measured_with, **row})
                    print(f"{mode} B={b} bucket {bucket}: {strategy.name}: {row['tokens_per_s']:.1f} tok/s "
                          f"(spread {row['spread_tokens_per_s']:.1f}, {row['runs']} runs), "
                          f"{row['tokens_per_iteration']:.2f} tokens/iteration, iteration {row['iteration_s'] * 1e3:.2f} ms",
                          flush=True)
                prompt_tokens = int(np.mean([x.lengths.mean() for x in batches]))
                # every strategy ran on every calibration batch (later batches run all of the first's, or none)
                whole = len(runs) == len(space) and all(len(r) == len(batches) for r in runs.values())
                for precision, rows in entries.items():
                    plain = [Strategy.from_json(e["strategy"]).plain for e in rows]
                    # a cell needs its plain entry; with --add, a cell the budget cut short adds nothing (its
                    # kept entries would sit beside fewer runs, and its plain entry be traded for them) and
                    # keeps its own
                    if any(plain) and (whole or not args.add):
                        tables.set_cell(table, b, mode, bucket, precision, rows, keep=args.add,
                                        prompt_tokens=prompt_tokens, prompts=args.prompts,
                                        **{k: profile[k] for k in tables.PROVENANCE})
                        cell = table["cells"][-1]
                        if args.replace:  # this head's entries take the place of every other head's
                            cell["ranked"] = [e for e in cell["ranked"] if not tables.another_head(e, head_id)]
                        measured.append(cell)
                if measured:
                    tables.save_table(out, table)
    return measured


def summary(cells: list[dict]) -> str:
    """Markdown: per cell the best strategy against plain."""
    lines = ["| sampling | batch | bucket | precision | best | tok/s | spread | tokens/iter | plain tok/s | x plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        best = c["ranked"][0]
        plain = next(e for e in c["ranked"] if Strategy.from_json(e["strategy"]).plain)
        lines.append(f"| {c['sampling']} | {c['batch']} | {c['bucket']} | {c['precision']} | {best['name']} | "
                     f"{best['tokens_per_s']:.1f} | {best['spread_tokens_per_s']:.1f} | {best['tokens_per_iteration']:.2f} | "
                     f"{plain['tokens_per_s']:.1f} | {best['tokens_per_s'] / plain['tokens_per_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    set_gpu_flags()
    main()
