"""generate's default request (`python -m jaxspec.generate` with no prompt): plain against eagle with
each head and draft shape, in one process.

    PYTHONPATH=. python3 bench/default_request.py [--heads checkpoints/eagle3-smollm2,DIR] [--model smollm2]
        [--shapes chain:4,bfs:3,2,1] [--samplings sample,greedy] [--draws sampled,top] [--new 256] [--repeats 3]
        [--planner-table FILE] [--first-seed 0] [--tiny] [--out DIR] [--tag T]

The request is the CLI's: DEFAULT_PROMPT through the chat template, batch 1, `--new` (generate's 256)
new tokens, stopping at EOS. Configs: plain, eagle with each head (default: the model's shipped one)
and shape (`bench/e2e.py`'s shapes), and auto, the default run itself (generate's plan with the first
head; its shape column is the planned strategy, its runs record where each ended). Each (sampling,
config) makes a first run (seed `--first-seed`), then runs with seeds `--first-seed`.. (median and
spread of decode tokens/s; `runner.timed_runs`: the first run carries the program's one-time first
execution, so it is kept apart; a sampled run's text and acceptance are its seed's, so runs with the
same seeds are one sample of texts). A row gives its speed over plain's, its first run's over plain's
first run's (what a fresh `generate` sees), tokens an iteration (the median, and the mean with its
standard error over the texts: two heads' sampled rows differ by their texts too), acceptance at
depths 1-3 and the ideal speed-up (tokens an iteration x plain's step floor / the iteration's floor,
`common.floors`; `of ideal`: the measured share of it), so the default-run target (>= 1.5x plain on
this request) reads off the table; each run records a digest of its text (a greedy text that changes
between machines shows there), and a greedy row the share of its runs whose text is plain's.
Writes DIR/default_request_<device><tag>.json after every row; prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import jax

from bench import common
from bench.e2e import auto_choices, spec_of, split_shapes
from jaxspec.generate import DEFAULT_PROMPT, plan_with_head
from jaxspec.loaders import load_model
from jaxspec.loaders.eagle import load_eagle, shipped_head
from jaxspec.models import draft_weights
from jaxspec.runner import encode_prompts, resolve_max_len, run_generation, timed_runs


def request_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a bench on generate's default request: new tokens, repeats, --tiny, --out, --tag."""
    p.add_argument("--new", type=int, default=256, help="new tokens (generate's default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, reference backend")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tag", default="", help="suffix of the file name")


def load_request(model: str, tiny: bool):
    """(backend, dtype, cfg, params, tokenizer, batch): `model` and generate's default request as one
    batch (float32 on the reference backend with `tiny`)."""
    backend, dtype = ("reference", "float32") if tiny else ("pallas", "bfloat16")
    cfg, params, tokenizer = load_model(model, dtype=dtype)
    return backend, dtype, cfg, params, tokenizer, encode_prompts(tokenizer, [DEFAULT_PROMPT],
                                                                  chat=tokenizer.has_chat_template)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default=None, help="EAGLE-3 head directories, comma-separated (default: the "
                                                 "model's shipped head); the first is auto's")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--shapes", default="chain:4", help="eagle's draft shapes, comma-separated (bench/e2e.py's)")
    p.add_argument("--samplings", default="sample,greedy", help="of bench.common.SAMPLINGS")
    p.add_argument("--draws", default=None, help="eagle's draws when sampling (SpecConfig.draws: sampled, top; "
                                                  "default: eagle's), comma-separated")
    p.add_argument("--planner-table", type=Path, default=None,
                   help="auto's table (generate's --planner-table; default: the shipped one of this device)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the runs' seeds start here (a sampled run's text, and so its acceptance, is its seed's)")
    request_flags(p)
    args = p.parse_args()
    backend, dtype, cfg, params, tokenizer, batch = load_request(args.model, args.tiny)
    max_len = resolve_max_len(batch, args.new, None, cfg.max_position_embeddings)
    heads = args.heads.split(",") if args.heads else [shipped_head(args.model)]
    if heads[0] is None:
        p.error(f"no head ships for {args.model}: give --heads")
    plain_spec = spec_of("plain", "", backend)
    loaded = [load_eagle(head, cfg, dtype) for head in heads]
    with_heads = [{**params, "eagle": jax.device_put(head_params)} for _, head_params in loaded]
    configs = [("plain", "", params, plain_spec)] + [  # (name, shape, weights, spec)
        (Path(head).name, shape + ("" if draws is None else f" draws {draws}"), weights,
         dataclasses.replace(spec_of("eagle", shape, backend, head=ecfg), draws=draws).validate())
        for head, (ecfg, _), weights in zip(heads, loaded, with_heads) for shape in split_shapes(args.shapes)
        for draws in (args.draws.split(",") if args.draws else [None])]
    device = "cpu" if args.tiny else jax.devices()[0].device_kind.split()[1].lower()
    path = args.out / f"default_request_{device}{args.tag}.json"
    result = common.run_info() | {"prompt_tokens": int(batch.lengths[0]), "new": args.new, "rows": []}
    rates, weight_bytes = common.measure_rates(args.tiny), common.tree_bytes(params)
    context = int(batch.lengths[0]) + args.new // 2  # the floors' mean context over the run
    for sampling_name in args.samplings.split(","):
        sampling, plain, plain_texts = common.SAMPLINGS[sampling_name], None, None
        # what the default run does: generate's plan, with the first head
        plan, auto_spec = plan_with_head(cfg, weight_bytes, plain_spec, loaded[0][0], heads[0], batch=1,
                                         prompt_tokens=int(batch.lengths[0]), new_tokens=args.new, sampling=sampling,
                                         table=args.planner_table)
        for name, shape, weights, spec, plan_of in [(*c, None) for c in configs] + [
                ("auto", plan.first.name, draft_weights.with_draft_weights(with_heads[0], plan.draft_weights),
                 auto_spec, plan)]:
            seeds = range(args.first_seed, args.first_seed + args.repeats)
            first, ran = timed_runs(lambda seed: run_generation(
                weights, cfg, batch, spec=spec, sampling=sampling, max_len=max_len, max_new_tokens=args.new,
                stop_ids=tokenizer.eos_token_ids, seed=seed, plan=plan_of), seeds)
            runs = [common.run_measures(run)[0] | (auto_choices(run) if plan_of else {}) for run in ran]
            row = {"sampling": sampling_name, "config": name, "shape": shape, "runs": runs,
                   **common.median_of_runs(runs), "first_run": common.run_measures(first)[0]}
            last = ran[0].auto.spec if plan_of else spec  # an auto row's floors: its first run's last strategy
            row |= common.floors(cfg, weight_bytes, last, 1, context, rates,
                                 common.tree_bytes(weights["eagle"]) if last.method == "eagle" else None)
            plain = plain or row
            row["x_plain"] = row["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
            row["ideal_x_plain"] = 1.0 if last.method == "plain" else (
                row["tokens_per_iteration"] * row["plain_floor_s"] / row["iteration_floor_s"])
            row["of_ideal"] = row["x_plain"] / row["ideal_x_plain"]
            row["first_run_x_plain"] = first_speed(row) / first_speed(plain)
            plain_texts = plain_texts or [r["text_digest"] for r in runs]
            if sampling_name == "greedy":  # lossless greedy emits plain's text, up to bf16's near-ties
                row["same_text_as_plain"] = statistics.mean(r["text_digest"] == t for r, t in zip(runs, plain_texts))
            tokens = [r["tokens_per_iteration"] for r in runs]
            row["tokens_per_iteration_mean_se"] = (f"{statistics.mean(tokens):.3f} ± "
                                                   f"{statistics.stdev(tokens) / len(tokens) ** 0.5:.3f}"
                                                   if len(tokens) > 1 else "")
            depths = range(min(3, *(len(r["acceptance_rate_by_depth"]) for r in runs)))
            row["acceptance_1_3"] = " ".join(
                f"{statistics.median(r['acceptance_rate_by_depth'][d] for r in runs):.2f}" for d in depths)
            result["rows"].append(row)
            common.write_json(path, result)  # after every row: a cut-off run keeps what it measured
            print(f"{sampling_name} {name} {row['shape']}: {row['decode_tokens_per_s']:.0f} tok/s, "
                  f"{row['x_plain']:.2f}x plain, {row['tokens_per_iteration']:.2f} tokens/iteration", flush=True)
    print(common.markdown_table(result["rows"], [
        ("sampling", "sampling", "s"), ("config", "config", "s"), ("shape", "shape", "s"),
        ("tok/s (median)", "decode_tokens_per_s", ".0f"), ("spread", "spread_tokens_per_s", ".0f"),
        ("x plain", "x_plain", ".2f"), ("ideal x plain", "ideal_x_plain", ".2f"), ("of ideal", "of_ideal", ".2f"),
        ("first run x plain", "first_run_x_plain", ".2f"), ("tokens / iteration", "tokens_per_iteration", ".2f"),
        ("tokens / iteration, mean ± s.e.", "tokens_per_iteration_mean_se", "s"),
        ("acceptance d1-3 (median)", "acceptance_1_3", "s"), ("iteration ms", "iteration_ms", ".2f"),
        ("degeneration", "degeneration", ".2f"), ("greedy text = plain's", "same_text_as_plain", ".2f")]))


def first_speed(row: dict) -> float:
    """Decode tokens/s of a row's first, untimed run, the one a fresh `generate` makes (its text is the
    first seed's, as the timed first seed's is: the two differ by the first execution's cost alone)."""
    return row["first_run"]["decode_tokens_per_s"]


if __name__ == "__main__":
    main()
