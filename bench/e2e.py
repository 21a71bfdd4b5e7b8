"""End-to-end decode speed on SmolLM2 (real weights): every method against plain decoding, in one
process on the same long real-text prompts, with the ideal speed-up beside each measured one.

    PYTHONPATH=. python3 bench/e2e.py [--model smollm2] [--batches 1,8,32,128]
        [--methods plain,vegas,stream,quest,ngram,auto,eagle] [--draft-model DIR[,DIR]] [--heldout] [--shapes chain:6,eagle=bfs:3,2,1] [--metrics weight,logit] [--ratios 0.035,0.07] [--balances 1,2]
        [--select-every 1,2] [--groups 0,8,1]
        [--draft-weights exact,int8,int4] [--draft-skip 4]
        [--samplings sample,greedy] [--draws sampled,top] [--shrink on,off]
        [--greedy-methods plain,vegas,auto] [--tuned FILE] [--prompt-tokens 7500] [--new 1024] [--repeats 3]
        [--tiny] [--out DIR] [--tag T] [--plot-from JSON]

Per batch: one prefill of real-text prompts (a different local document per row, a continuation
request, chat template), then every (method, shape) through `run_generation` (the generate path),
each repeated with seeds 0.. after a discarded run (`runner.timed_runs`; median and spread of decode
tokens/s). Sampling (T 0.7, top-p 0.95) is the headline; greedy runs beside it for --greedy-methods
(greedy SmolLM2 loops at long context, which inflates acceptance: degeneration, the share of repeated
4-grams in the outputs, says how much). Every method at gamma 6, ratio 0.07 (bench/kv_bound.json's
choice) unless --tuned names a
`python -m jaxspec.tune` file (or bench/kv_bound.json), whose per-method (gamma, ratio, metric, and the
settings of its `batches` for each batch: `jaxspec.decoding.spec.at_batch`) then apply to chains;
--metrics runs the score methods with each named metric, --ratios the sparse drafters with each budget
ratio (the last of Vegas' tuning steps, the ratio re-adjusted for throughput at the chosen gamma),
--balances with each budget balance (`SpecConfig.balance`: rows share the budget by their lost drafts),
--select-every the score methods selecting after every N-th verification (`SpecConfig.select_every`),
--groups (NSA models) the drafters with each verification group (`SpecConfig.group`).
--shrink on,off runs the drafting methods with and without shrinking the batch as its rows finish
(`run_generation`'s `shrink`, off by default as in `generate`; plain's rows finish together, so it
runs once, with the first setting). `auto` is `generate`'s default, `--method auto`: the planner's
plan for the batch (the shipped table of this model and device, else the cost model) with the run's
head among its strategies, refined and switched as it runs; its row gives the strategy each run ended
with and the ideal of the first run's. The head of eagle and auto is the model's shipped one, as in
generate, unless --draft-model names others: A,B compares heads in one process, B's eagle rows on B's
own prefill of the same prompts (one program: the same bits, so greedy texts are plain's whatever
the head).

The ideal speed-up is a projection from measured acceptance and the bytes floors: tokens per
iteration x plain step floor / iteration floor, the iteration floor being depth draft forwards over
the selection (weights + the method's budget of keys; none for ngram) plus the verify pass (weights
+ every key + the rows' float32 logits). `of ideal` = measured speed-up / ideal speed-up.
Writes DIR/e2e_<device><tag>.json after every row, a plot of tokens/s against batch per method
(DIR/e2e_<device><tag>.png), and prints the table last. --plot-from draws the rows of several such
JSON files (batches measured in separate runs) into DIR/e2e<tag>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from jaxspec import planner
from jaxspec.decoding.spec import (MAX_BALANCE, MAX_SELECT_EVERY, SCORE_METHODS, SPARSE_METHODS, SpecConfig, at_batch,
                                  spec_from_settings, takes_draft_model)
from jaxspec.decoding.tree import TreeShape
from jaxspec.generate import plan_with_head
from jaxspec.loaders import load_model
from jaxspec.models import draft_weights
from jaxspec.loaders.eagle import load_eagle, shipped_head
from jaxspec.runner import run_generation, timed_runs
from pallas_kernels.verify_attention import METRICS

METHODS = ("plain", "vegas", "stream", "quest", "ngram", "auto")
GAMMA, RATIO = 6, 0.07


def spec_of(method: str, shape: str, backend: str, tuning: dict | None = None, metric: str | None = None,
            ratio: float | None = None, balance: float | None = None, select_every: int | None = None,
            head=None) -> SpecConfig:
    """'chain:G' or '<bfs|dfs>:TREE' (a --tree: 3,2 or 5,3+1) -> the method's SpecConfig
    (`spec_from_settings`): the tuned choice of `method` in `tuning` (its settings at the batch) sets the
    ratio, metric, balance and select_every unless they are given, and replaces a chain's gamma (its
    tree is not used: the shape is); plain takes none of them; eagle takes the head's config `head`."""
    if method == "plain":
        return spec_from_settings(backend=backend)
    choice = (tuning or {}).get(method, {})
    settings = dict(tuned=choice, ratio=ratio, metric=metric, balance=balance, select_every=select_every, backend=backend,
                    eagle=head if method == "eagle" else None)
    kind, _, value = shape.partition(":")
    if kind == "chain":
        return spec_from_settings(method, gamma=choice.get("gamma") or int(value), **settings)
    tree = TreeShape.parse(value, kind)
    return spec_from_settings(method, tree=tree.branching, traversal=tree.order, **settings)


def run_rows(args, cfg, params, tokenizer, rates, rows_out, save, tuning=None, heads=((None, None, None),)):
    """Every (batch, sampling, method, shape) of args, appended to rows_out (save() after each).
    `heads`: (directory, config, params) of each EAGLE-3 head that method eagle drafts with, the first
    one's already params["eagle"] and auto's; the first runs every method, each other one only eagle,
    on its own prefill of the same prompts (the same program, so the same bits: greedy texts are
    plain's for every head, and the heads compare on them)."""
    backend = "reference" if args.tiny else "pallas"
    weight_bytes = common.tree_bytes({k: v for k, v in params.items() if k != "eagle"})
    skips = [()] + ([draft_weights.parse_skip(args.draft_skip, cfg.num_layers)] if args.draft_skip else [])
    drafts = [(w, skip) for w in args.draft_weights for skip in skips]
    with_copies = {(w, skip): draft_weights.with_draft_weights(params, w, skip) for w, skip in drafts}
    plain_of = {}  # (batch, sampling) -> plain's tokens/s and first run's rows
    for batch_size, (k, (head_dir, head, head_params)) in itertools.product(args.batches, enumerate(heads)):
        with_head = params if k == 0 else {**params, "eagle": head_params}
        batch, max_len, cache = common.real_text_batch(cfg, with_head, tokenizer, batch_size, args.prompt_tokens,
                                                       args.new, backend, head, args.heldout)
        context = int(batch.lengths.mean()) + args.new // 2
        tuned = {m: at_batch(choice, batch_size) for m, choice in (tuning or {}).items()}  # this batch's settings
        for sampling_name in args.samplings:
            sampling = common.SAMPLINGS[sampling_name]
            methods = args.greedy_methods if sampling_name == "greedy" else args.methods
            methods = methods if k == 0 else [m for m in methods if m == "eagle"]
            specs = [spec_of("plain", "", backend)] * (k == 0) + [
                dataclasses.replace(spec_of(m, s, backend, tuned, metric, ratio, balance, every, head), draft_weights=w,
                                    draft_skip=skip, group=group, draws=draws).validate()
                for m in methods if m not in ("plain", "auto") for s in shapes_of(args.shapes, m) for w, skip in drafts
                for draws in (args.draws if m != "ngram" and sampling_name != "greedy" else [None])
                for group in (args.groups if cfg.nsa else [SpecConfig.group])
                if takes_draft_model(m, w, skip)
                for metric in (args.metrics if m in SCORE_METHODS else [None])
                for ratio in (args.ratios if m in SPARSE_METHODS else [None])
                for balance in (args.balances if m in SPARSE_METHODS else [None])
                for every in (args.select_every if m in SCORE_METHODS else [None])]
            if k == 0:  # the first head's plain row is every head's
                plain_of[batch_size, sampling_name] = None, None
            plain_tps, plain_rows = plain_of[batch_size, sampling_name]
            shrunk_rows = {}  # spec -> its first run's outputs with shrinking
            runs_of = [(spec, shrink, None) for spec in specs for shrink in (args.shrink[:1] if spec.method == "plain" else args.shrink)]
            if "auto" in methods:  # generate's default: the planner's plan for this batch, with the first head
                plan, auto_spec = plan_with_head(cfg, weight_bytes, spec_of("plain", "", backend), head, head_dir,
                                                 batch=batch_size, prompt_tokens=int(batch.lengths.max()),
                                                 new_tokens=args.new, sampling=sampling)
                if (plan.draft_weights, ()) not in with_copies:
                    with_copies[plan.draft_weights, ()] = draft_weights.with_draft_weights(params, plan.draft_weights)
                runs_of.append((auto_spec, args.shrink[0], plan))
            for spec, shrink, plan in runs_of:
                runs, first_rows = [], None
                weights = with_head if k else with_copies.get(
                    (plan.draft_weights, ()) if plan else (spec.draft_weights, spec.draft_skip), params)
                _, timed = timed_runs(lambda seed: run_generation(
                    weights, cfg, batch, spec=spec, sampling=sampling, max_len=max_len, max_new_tokens=args.new,
                    stop_ids=(), seed=seed, cache=jax.tree.map(jnp.copy, common.cache_for(spec, cache)), plan=plan,
                    shrink=shrink), range(args.repeats))
                for repeat, run in enumerate(timed):
                    measures, outputs = common.run_measures(run)
                    runs.append(measures | {"compile_s": run.compile_s} | (auto_choices(run) if plan else {}))
                    first_rows = first_rows or outputs
                    if repeat == 0:  # an auto row's floors and ideal: its first run's last strategy
                        ran = run.auto.spec if plan else spec
                described = ran.describe() | ({"method": "auto", "planned": plan.describe()} if plan else {})
                row = {"skipped_layers": len(ran.draft_skip), "batch": batch_size, "prompt_tokens": int(batch.lengths.mean()), "new_tokens": args.new,
                       "sampling": sampling_name, **described, "rows": 1 + described["nodes"], "shrink": "on" if shrink else "off", "runs": runs,
                       **common.median_of_runs(runs)}
                if ran.method == "eagle":
                    row["head"] = Path(head_dir).name
                draft_bytes = (common.tree_bytes(with_head["eagle"]) if ran.method == "eagle"
                               else draft_weights.read_bytes(cfg, weight_bytes, ran.draft_weights, ran.draft_skip))
                row |= common.floors(cfg, weight_bytes, ran, batch_size, context, rates, draft_bytes)
                if spec.method == "plain" and not plan:
                    plain_tps, plain_rows = plain_of[batch_size, sampling_name] = row["decode_tokens_per_s"], first_rows
                    row["ratio_to_floor"] = row["iteration_ms"] / (row["plain_floor_s"] * 1e3)
                else:
                    if sampling_name == "greedy":  # bf16: a near-tie may flip between row counts
                        row["greedy_rows_equal_plain"] = share_equal(first_rows, plain_rows)
                    if shrink and not plan:  # (auto's strategies are its own: no shrunk twin to compare with)
                        shrunk_rows[spec] = first_rows
                    elif spec in shrunk_rows and not plan:  # the same seed's rows: bf16 near-ties may flip with the batch size
                        row["rows_equal_shrunk"] = share_equal(first_rows, shrunk_rows[spec])
                    row["speedup"] = row["decode_tokens_per_s"] / plain_tps
                    # an auto run that ended on plain: its ideal is plain's (its speculative segments aside)
                    row["ideal_speedup"] = 1.0 if ran.method == "plain" else (
                        row["tokens_per_iteration"] * row["plain_floor_s"] / row["iteration_floor_s"])
                    row["of_ideal"] = row["speedup"] / row["ideal_speedup"]
                rows_out.append(row)
                save()
                shape = ((row["tree"] and f"{row['traversal']}:{row['tree']}" or f"chain:{row['gamma']}") + draft_label(row)
                         + (f" {row['metric']}" if row["metric"] else "") + (f" ratio {row['ratio']}" if row["ratio"] else "")
                         + (f" balance {row['balance']:g}" if row.get("balance") not in (None, 1) else "")
                         + (f" select every {row['select_every']}" if row.get("select_every") not in (None, 1) else "")
                         + ("" if shrink else " no shrink")
                         + (f" (auto: {', '.join(r['strategy'] for r in runs)}; {sum(r['switches'] for r in runs)} switches)" if plan else ""))
                print(f"B={batch_size} {sampling_name} {row['method']} {shape}: {row['decode_tokens_per_s']:.0f} tok/s "
                      f"(spread {row['spread_tokens_per_s']:.0f}), {row['tokens_per_iteration']:.2f} tokens/iteration, "
                      f"iteration {row['iteration_ms']:.2f} ms, degeneration {row['degeneration']:.2f}", flush=True)


def auto_choices(run) -> dict:
    """What an auto run ended with (its last strategy's name), how many times it switched, and its
    refinement segments (each with its slowest running row's tokens per iteration)."""
    return {"strategy": planner.Strategy.of(run.auto.spec).name, "switches": len(run.auto.switches),
            "segments": run.auto.segments}


def share_equal(rows: list, reference: list) -> float:
    """The share of rows equal to the reference's row."""
    return sum(a == b for a, b in zip(rows, reference)) / len(reference)


def draft_label(row: dict) -> str:
    """' int4 skip 2' for a draft model other than the exact one ('' for it), ' DIR' for a head, ' draws
    top' / ' draws sampled' for draws other than the method's default for its shape (`SpecConfig.draw_mode`)."""
    shape = TreeShape.parse(row["tree"]) if row.get("tree") else TreeShape.chain(row.get("gamma") or 1)
    return ((f" {row['draft_weights']}" if row.get("draft_weights", "exact") != "exact" else "")
            + (f" skip {len(row['draft_skip'])}" if row.get("draft_skip") else "")
            + (f" {row['head']}" if row.get("head") else "")
            + (f" draws {row['draws']}"
               if row.get("draws") not in (None, SpecConfig(method=row["method"], tree=shape.branching).draw_mode)
               else ""))


def table(rows: list[dict]) -> str:
    return common.markdown_table(rows, [
        ("B", "batch", "d"), ("sampling", "sampling", "s"), ("method", "method", "s"), ("head", "head", "s"),
        ("draws", "draws", "s"), ("gamma", "gamma", "d"),
        ("ratio", "ratio", ".2f"), ("balance", "balance", "g"), ("select every", "select_every", "d"), ("metric", "metric", "s"), ("tree", "tree", "s"), ("order", "traversal", "s"), ("rows", "rows", "d"),
        ("group", "group", "d"),
        ("draft weights", "draft_weights", "s"), ("skipped", "skipped_layers", "d"), ("shrink", "shrink", "s"),
        ("tok/s (median)", "decode_tokens_per_s", ".0f"), ("spread", "spread_tokens_per_s", ".0f"),
        ("tokens/iter", "tokens_per_iteration", ".2f"), ("iter ms", "iteration_ms", ".2f"),
        ("iterations (slowest row)", "iterations_max", ".0f"), ("iterations (mean row)", "iterations_mean", ".1f"),
        ("x plain", "speedup", ".2f"), ("ideal x plain", "ideal_speedup", ".2f"), ("of ideal", "of_ideal", ".2f"),
        ("x floor (plain)", "ratio_to_floor", ".2f"), ("degeneration", "degeneration", ".2f")])


def tuned(row: dict, tuning: dict | None) -> bool:
    """Whether a chain row ran its method's tuned setting at its batch (the spec `spec_of` makes from the
    --tuned file, whatever flags chose it), so that the plot draws a method tuned per batch as one line.
    A setting missing from an older row did not exist then: it ran the default."""
    if not tuning or row["method"] not in tuning or row["tree"]:
        return False
    choice = {row["method"]: at_batch(tuning[row["method"]], row["batch"])}
    want = spec_of(row["method"], f"chain:{GAMMA}", "reference", choice).describe()
    return all(row.get(key, want[key]) == want[key] for key in ("gamma", "ratio", "metric", "balance", "select_every"))


def line_label(row: dict, tuning: dict | None) -> str:
    """A row's line in the plot: plain, auto, a method at its tuned setting, or a method and its settings."""
    if row["method"] in ("plain", "auto"):
        label = row["method"]
    elif tuned(row, tuning):
        label = f"{row['method']} tuned" + draft_label(row)
    else:
        label = (f"{row['method']} " + (row["tree"] and f"{row['traversal']}:{row['tree']}" or f"gamma {row['gamma']}")
                 + draft_label(row) + (f" ratio {row['ratio']}" if row.get("ratio") not in (None, RATIO) else "")
                 + (f" balance {row['balance']:g}" if row.get("balance") not in (None, 1) else "")
                 + (f" select every {row['select_every']}" if row.get("select_every") not in (None, 1) else "")
                 + (f" group {row['group']}" if row.get("group") not in (None, SpecConfig.group) else ""))
    return label + (" shrink" if row.get("shrink") == "on" else "")


def plot(results: list[dict], path: Path) -> None:
    """Decode tokens/s against batch, one line per (method, shape), one panel per sampling; a method
    at its tuned setting (results' `tuning`, which may differ by batch) is one line, "tuned". Without
    matplotlib installed, no plot."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(r, result.get("tuning")) for result in results for r in result["rows"]]
    samplings = sorted({r["sampling"] for r, _ in rows}, key=lambda s: s != "sample")
    batches = sorted({r["batch"] for r, _ in rows})
    fig, axes = plt.subplots(1, len(samplings), figsize=(6 * len(samplings), 4.5), squeeze=False)
    for ax, sampling in zip(axes[0], samplings):
        lines: dict[str, list] = {}
        for r, tuning in rows:
            if r["sampling"] == sampling:
                lines.setdefault(line_label(r, tuning), []).append((r["batch"], r["decode_tokens_per_s"], r["spread_tokens_per_s"]))
        for label, points in lines.items():
            points.sort()
            ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] / 2 for p in points],
                        marker="o", capsize=3, label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s", title=f"SmolLM2, {sampling}")
        ax.set_xticks(batches, labels=[str(b) for b in batches])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def split_shapes(text: str) -> list[str]:
    """'chain:6,chain:15,bfs:3,2,1' -> ['chain:6', 'chain:15', 'bfs:3,2,1'] (a shape's branching has commas)."""
    shapes = []
    for part in text.split(","):
        if ":" in part or not shapes:
            shapes.append(part)
        else:
            shapes[-1] += "," + part
    return shapes


def shapes_of(shapes: list[str], method: str) -> list[str]:
    """The shapes `method` runs: 'M=shape' entries are method M's only, the others every method's."""
    return [s.partition("=")[2] if "=" in s else s for s in shapes if "=" not in s or s.partition("=")[0] == method]


def numbers(p: argparse.ArgumentParser, flag: str, text: str | None, ok, bounds: str) -> list[float | None]:
    """'0.035,0.07' -> [0.035, 0.07], or [None] when the flag is not given; `p.error` unless every
    number is `ok` (within `bounds`, as the message says)."""
    if not text:
        return [None]
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(ok(v) for v in values):
        p.error(f"{flag}: comma-separated numbers in {bounds}, got {text!r}")
    return values


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--shapes", default=f"chain:{GAMMA}")
    p.add_argument("--draft-weights", default="exact", help="exact,int8,int4: the model drafters' draft weights to run")
    p.add_argument("--draft-skip", default=None, help="also run each draft weights kind skipping these layers (3,5 | everyN)")
    p.add_argument("--metrics", default=None,
                   help="weight,logit: run the score methods (vegas, all_rows, last_accepted) with each (default: the --tuned choice, else weight)")
    p.add_argument("--ratios", default=None,
                   help="0.035,0.07: run the sparse drafters with each budget ratio (default: the --tuned choice, else 0.07)")
    p.add_argument("--balances", default=None,
                   help="1,2: run the sparse drafters with each budget balance (default: the --tuned choice, else 1)")
    p.add_argument("--select-every", default=None,
                   help="1,2: run the score methods selecting after every N-th verification (default: the --tuned choice, else 1)")
    p.add_argument("--draws", default=[None], type=lambda s: s.split(","),
                   help="a model drafter's children when sampling (SpecConfig.draws: sampled, top; default: the "
                        "method's), comma-separated")
    p.add_argument("--groups", default="0", type=lambda s: [int(n) for n in s.split(",")],
                   help="NSA models: the drafters' verification groups (adjacent draft rows per program), each run")
    p.add_argument("--samplings", default="sample,greedy", help="of bench.common.SAMPLINGS")
    p.add_argument("--greedy-methods", default="plain,vegas,auto", help="the methods run greedy (sampling runs --methods)")
    p.add_argument("--shrink", default="off", help="on,off: shrink the batch as its rows finish, or not, or both")
    p.add_argument("--tuned", type=Path, default=None, help="a `python -m jaxspec.tune` file")
    p.add_argument("--draft-model", default=None,
                   help="the EAGLE-3 heads that method eagle drafts with, comma-separated (compared in one process; "
                        "default: the model's shipped head, as generate), the first also auto's")
    p.add_argument("--heldout", action="store_true", help="prompts from the held-out documents only (training.data)")
    p.add_argument("--prompt-tokens", type=int, default=7500)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, reference backend")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tag", default="", help="suffix of the file names")
    p.add_argument("--plot-from", type=Path, nargs="+", default=None, help="plot the rows of these e2e JSON files and exit")
    args = p.parse_args()
    if args.plot_from:
        plot([json.loads(f.read_text()) for f in args.plot_from], args.out / f"e2e{args.tag}.png")
        return
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.methods = args.methods.split(",")
    args.greedy_methods = args.greedy_methods.split(",")
    args.shapes = split_shapes(args.shapes)
    args.draft_weights = args.draft_weights.split(",")
    args.samplings = args.samplings.split(",")
    args.metrics = args.metrics.split(",") if args.metrics else [None]
    args.ratios = numbers(p, "--ratios", args.ratios, lambda r: 0 < r <= 1, "(0, 1]")
    args.balances = numbers(p, "--balances", args.balances, lambda b: 1 <= b <= MAX_BALANCE, f"[1, {MAX_BALANCE:g}]")
    args.select_every = [None if n is None else int(n) for n in numbers(
        p, "--select-every", args.select_every, lambda n: n == int(n) and 1 <= n <= MAX_SELECT_EVERY, f"1..{MAX_SELECT_EVERY}")]
    args.shrink = [{"on": True, "off": False}.get(x) for x in args.shrink.split(",")]
    if None in args.shrink:
        p.error("--shrink: on, off or both (comma-separated)")
    if args.metrics != [None] and not set(args.metrics) <= set(METRICS):
        p.error(f"--metrics: choose from {', '.join(METRICS)}")
    tuning = json.loads(args.tuned.read_text())["methods"] if args.tuned else None
    rates = common.measure_rates(args.tiny)
    dtype = "float32" if args.tiny else "bfloat16"
    cfg, params, tokenizer = load_model(args.model, dtype=dtype)
    heads = [(None, None, None)]
    drafting = {"eagle", "auto"} & set(args.methods + args.greedy_methods)
    head_dirs = args.draft_model.split(",") if args.draft_model else [shipped_head(args.model) if drafting else None]
    if head_dirs[0] is not None:  # as generate: eagle and auto take the shipped head unless told otherwise
        heads = [(d, *load_eagle(d, cfg, dtype)) for d in head_dirs]
        heads = [(d, head, jax.device_put(head_params)) for d, head, head_params in heads]
        params = {**params, "eagle": heads[0][2]}
    elif "eagle" in args.methods + args.greedy_methods:
        p.error("method eagle needs --draft-model")
    device = "cpu" if args.tiny else jax.devices()[0].device_kind.split()[1].lower()
    result = common.run_info() | {"rates": rates, "tuning": tuning, "rows": []}
    path = args.out / f"e2e_{device}{args.tag}.json"
    run_rows(args, cfg, params, tokenizer, rates, result["rows"], lambda: common.write_json(path, result), tuning, heads)
    plot([result], path.with_suffix(".png"))
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
