"""The planner benchmark (`--method auto`; the form of SSV's Table 3): per context bucket, on held-out
prompts, decode tokens/s of Base, Static-best and Auto beside plain; then generate's default run.

    PYTHONPATH=. python3 bench/planner.py [--model smollm2] [--table FILE] [--buckets 1024,2048,4096,8000]
        [--batch 1] [--new 256] [--repeats 3] [--samplings sample,greedy] [--tiny] [--out DIR]

Rows per (sampling, bucket), each repeated with seeds 0.. (median and spread):
- Base: one fixed strategy, vegas gamma 6 ratio 0.07 (the old CLI default);
- Static-best: the plan's first choice (the table's top entry for the bucket, or the cost model's
  without a table) run to completion, no refinement;
- Auto: `runner.run_generation` with the same plan, refining over the first segments (what `--method auto`
  runs); its final strategy and switches are recorded;
- plain.
Prompts: `common.real_text_batch` (jaxspec.corpus documents from offset 0 with a continuation request,
a different document per row, chat template) of bucket - new - 32 tokens, held out from the
profile's calibration prompts, which start at document `jaxspec.profile.CALIBRATION_OFFSET` (40).
The default run: generate's DEFAULT_PROMPT, chat template, batch 1, greedy, `--cli-new` (generate's
default 256) new tokens, stopping at EOS as the CLI does: auto against plain (auto must not be slower).
The plan comes from `--table` or the shipped table of this model and device, else the cost model.
Writes DIR/planner_<device>.json (after every row); prints the markdown table last.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from jaxspec import planner
from jaxspec.decoding.spec import SpecConfig, spec_from_settings
from jaxspec.generate import DEFAULT_PROMPT
from jaxspec.loaders import load_model
from jaxspec.planner import tables
from jaxspec.runner import encode_prompts, resolve_max_len, run_generation

BASE = planner.Strategy("vegas", gamma=6, ratio=0.07)


def measured(runs_out: list, name: str, plan, **row) -> dict:
    """A result row: the median of `runs_out` (common.run_measures of each run) and the plan."""
    return {**row, "config": name, "planned": plan.first.name, "source": plan.source, "runs": runs_out,
            **common.median_of_runs(runs_out)}


def run_configs(params, cfg, batch, cache, plan, base: SpecConfig, sampling, max_len: int, new: int, stop_ids, repeats: int):
    """{config: (measures of each repeat, auto's final strategy and switches per repeat)} for plain,
    Base, Static-best and Auto on one batch (`cache`, if given, its prefill; copied for each run)."""
    fixed = {"plain": planner.Strategy(), "base": BASE, "static-best": plan.first}
    out = {}
    for name, strategy in fixed.items():
        runs = []
        for seed in range(repeats):
            copy = None if cache is None else jax.tree.map(jnp.copy, cache)
            run = run_generation(params, cfg, batch, spec=strategy.spec(base), sampling=sampling, max_len=max_len,
                                 max_new_tokens=new, stop_ids=stop_ids, seed=seed, cache=copy)
            runs.append(common.run_measures(run)[0])
        out[name] = (runs, {"strategy": strategy.name})
    runs, chosen = [], []
    for seed in range(repeats):
        run = run_generation(params, cfg, batch, plan=plan, spec=base, sampling=sampling, max_len=max_len, max_new_tokens=new,
                       stop_ids=stop_ids, seed=seed)
        runs.append(common.run_measures(run)[0])
        chosen.append({"final": planner.Strategy.of(run.auto.spec).name,
                       "switches": [f"{s['from']} -> {s['to']} @ {s['iteration']}" for s in run.auto.switches]})
    out["auto"] = (runs, {"strategy": chosen[0]["final"], "auto_runs": chosen})
    return out


def add_rows(result: dict, save, outs: dict, plan, **row) -> None:
    """Appends one row per config of `outs` (with its speed over plain's), saves, prints each."""
    plain = common.median_of_runs(outs["plain"][0])["decode_tokens_per_s"]
    for name, (runs, info) in outs.items():
        r = measured(runs, name, plan, **row, **info)
        r["x_plain"] = r["decode_tokens_per_s"] / plain
        result["rows"].append(r)
        save()
        print(f"{row['part']} {row['sampling']} bucket {row['bucket']} {name} ({info['strategy']}): "
              f"{r['decode_tokens_per_s']:.1f} tok/s (spread {r['spread_tokens_per_s']:.1f}), {r['x_plain']:.2f}x plain, "
              f"{r['tokens_per_iteration']:.2f} tokens/iteration", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--table", type=Path, default=None, help="a planner table (default: the shipped one, else the cost model)")
    p.add_argument("--buckets", default="1024,2048,4096,8000")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new", type=int, default=256, help="new tokens per bucket run")
    p.add_argument("--cli-new", type=int, default=256, help="new tokens of the default-run comparison")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samplings", default="sample,greedy")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, reference backend, buckets 256,512, 32 new tokens")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    if args.tiny:
        buckets, args.new, args.cli_new = [256, 512], 32, 32
    backend = "reference" if args.tiny else "pallas"
    cfg, params, tokenizer = load_model(args.model, dtype="float32" if args.tiny else "bfloat16")
    weight_bytes = planner.tree_bytes(params)
    base = spec_from_settings(backend=backend)
    device = "cpu" if args.tiny else jax.devices()[0].device_kind.split()[1].lower()
    path = args.out / f"planner_{device}.json"
    result = common.run_info() | {"rates": common.measure_rates(args.tiny), "rows": []}
    save = lambda: common.write_json(path, result)  # after every row: a cut-off run keeps what it measured

    def plan_for(batch, new, sampling):
        return planner.make_plan(cfg, weight_bytes, batch=len(batch.lengths), prompt_tokens=int(batch.lengths.max()),
                                 new_tokens=new, sampling=sampling, table=args.table)

    for sampling_name in args.samplings.split(","):
        sampling = common.SAMPLINGS[sampling_name]
        for bucket in buckets:
            batch, max_len, cache = common.real_text_batch(cfg, params, tokenizer, args.batch, bucket - args.new - 32,
                                                           args.new, backend)
            plan = plan_for(batch, args.new, sampling)
            outs = run_configs(params, cfg, batch, cache, plan, base, sampling, max_len, args.new, (), args.repeats)
            add_rows(result, save, outs, plan, part="bucket", sampling=sampling_name, bucket=bucket, batch=args.batch,
                     prompt_tokens=int(batch.lengths.max()))

    # generate's default run: DEFAULT_PROMPT, chat, batch 1, greedy, stops at EOS
    batch = encode_prompts(tokenizer, [DEFAULT_PROMPT], chat=tokenizer.has_chat_template)
    max_len = resolve_max_len(batch, args.cli_new, None, cfg.max_position_embeddings)
    sampling = common.SAMPLINGS["greedy"]
    plan = plan_for(batch, args.cli_new, sampling)
    outs = run_configs(params, cfg, batch, None, plan, base, sampling, max_len, args.cli_new, tokenizer.eos_token_ids,
                       args.repeats)
    add_rows(result, save, outs, plan, part="default run", sampling="greedy", bucket=tables.bucket_of(max_len), batch=1,
             prompt_tokens=int(batch.lengths[0]))
    print(common.markdown_table(result["rows"], [
        ("part", "part", "s"), ("sampling", "sampling", "s"), ("bucket", "bucket", "d"), ("prompt", "prompt_tokens", "d"),
        ("config", "config", "s"), ("strategy", "strategy", "s"), ("tok/s (median)", "decode_tokens_per_s", ".1f"),
        ("spread", "spread_tokens_per_s", ".1f"), ("x plain", "x_plain", ".2f"), ("tokens/iter", "tokens_per_iteration", ".2f"),
        ("iter ms", "iteration_ms", ".2f"), ("degeneration", "degeneration", ".2f"), ("source", "source", "s")]))


if __name__ == "__main__":
    main()
