"""The real-weights NSA model end to end: plain NSA decoding against dense SmolLM2, and every drafter's
tokens per iteration and decode speed on the NSA target, all in one process on the same prompts;
with --precisions, SSV's verification per precision class (docs/architecture.md, "NSA and SSV").

    PYTHONPATH=. python3 bench/nsa_e2e.py --nsa checkpoints/nsa-smollm2 [--dense smollm2] [--batches 1,8]
        [--prompt-tokens 7000] [--new 512] [--repeats 3] [--methods ...] [--trees 3,2,1;2,2,2]
        [--precisions strict,reuse,approx,approx+reuse] [--group 8] [--ratio 0.07] [--samplings sample,greedy]
        [--tiny] [--out DIR]

Every drafting method runs as a chain of --gamma drafts and as each --trees shape (BFS), under each
precision class (plain decoding under the reuse classes too: the reuse model is cheaper per step;
the approx classes change only multi-row verification). Only strict is lossless: rows carry
`precision` and `lossless`. The reuse classes need a checkpoint with a calibrated schedule
(python -m jaxspec.convert ... --to-nsa --calibrate-reuse KL).

Prompts: real local text (pydoc topics, a different document per row) + a continuation request, chat
template. Sampling (T 0.7, top-p 0.95) is the headline; greedy stands beside it. Degeneration = the
share of repeated 4-grams in the generated tokens (greedy SmolLM2 loops at long context, which inflates
acceptance). Every method at gamma 6, ratio 0.07 by default (bench/kv_bound.json's choice), bf16,
pallas backend on a GPU. Writes DIR/nsa_e2e_<device><tag>.json; prints the table last.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from jaxspec.decoding.spec import spec_from_settings
from jaxspec.decoding.tree import TreeShape
from jaxspec.loaders import load_model
from jaxspec.runner import run_generation

METHODS = ("plain", "vegas", "all_rows", "last_accepted", "stream", "quest", "ngram")


def strategies(methods, trees, precisions):
    """(method, tree or None, precision) in run order: plain first, then each drafter's chain and trees."""
    for precision in precisions:
        for method in methods:
            if method == "plain":
                if not precision.startswith("approx"):  # approx changes multi-row verification only
                    yield method, None, precision
                continue
            for tree in [None] + trees:
                yield method, tree, precision


def run_model(name, path, methods, args, rows_out, rates):
    cfg, params, tokenizer = load_model(path, dtype="float32" if args.tiny else "bfloat16")
    backend = "reference" if args.tiny else "pallas"
    weight_bytes = common.tree_bytes(params)
    precisions = args.precisions if cfg.nsa else ["strict"]
    for batch_size in args.batches:
        batch, max_len, cache = common.real_text_batch(cfg, params, tokenizer, batch_size, args.prompt_tokens, args.new, backend)
        for sampling_name in args.samplings:
            sampling = common.SAMPLINGS[sampling_name]
            for method, tree, precision in strategies(methods, args.trees, precisions):
                spec = spec_from_settings(method, gamma=args.gamma, tree=tree, ratio=args.ratio, backend=backend,
                                          precision=precision, group=args.group).check_model(cfg)
                runs = []
                for repeat in range(args.repeats):
                    run = run_generation(params, cfg, batch, spec=spec, sampling=sampling, max_len=max_len,
                                         max_new_tokens=args.new, stop_ids=(), seed=repeat, cache=jax.tree.map(jnp.copy, cache))
                    runs.append(common.run_measures(run)[0])
                row = {"model": name, "batch": batch_size, "prompt_tokens": int(batch.lengths.mean()), "new_tokens": args.new,
                       "sampling": sampling_name, **spec.describe(), "runs": runs,
                       **common.median_of_runs(runs)}
                if method == "plain":
                    step = statistics.median(r["decode_s"] / r["steps"] for r in runs)
                    floor = common.step_floor_s(cfg, weight_bytes, batch_size, int(batch.lengths.mean()) + args.new // 2, rates["copy_GBps"])
                    row |= {"step_ms": step * 1e3, "floor_ms": floor * 1e3, "ratio_to_floor": step / floor}
                rows_out.append(row)
                print(f"{name} B={batch_size} {sampling_name} {method} {row['tree'] or ''} {precision}: "
                      f"{row['decode_tokens_per_s']:.0f} tok/s (spread {row['spread_tokens_per_s']:.0f}), "
                      f"{row['tokens_per_iteration']:.2f} tokens/iteration, degeneration {row['degeneration']:.2f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nsa", required=True, help="the NSA checkpoint (python -m jaxspec.convert smollm2 DST --to-nsa)")
    p.add_argument("--dense", default="smollm2")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--prompt-tokens", type=int, default=7000)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samplings", default="sample,greedy", help="of bench.common.SAMPLINGS")
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--ratio", type=float, default=0.07)
    p.add_argument("--trees", default="", help="tree shapes besides the chain, ';'-separated (e.g. 3,2,1;2,2,2)")
    p.add_argument("--precisions", default="strict", help="SSV precision classes for the NSA model")
    p.add_argument("--group", type=int, default=8, help="rows per program of NSA verification")
    p.add_argument("--tag", default="", help="suffix of the JSON file's name")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, reference backend")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",")
    args.trees = [TreeShape.parse(t).branching for t in args.trees.split(";") if t]
    args.precisions = args.precisions.split(",")
    args.samplings = args.samplings.split(",")
    rates = common.measure_rates(args.tiny)
    result = common.run_info() | {"rates": rates, "rows": []}
    run_model("smollm2-dense", args.dense, ["plain"], args, result["rows"], rates)
    run_model("smollm2-nsa", args.nsa, methods, args, result["rows"], rates)
    device = "cpu" if args.tiny else jax.devices()[0].device_kind.split()[1].lower()
    common.write_json(args.out / f"nsa_e2e_{device}{args.tag}.json", result)
    print(common.markdown_table(result["rows"], [
        ("model", "model", "s"), ("B", "batch", "d"), ("sampling", "sampling", "s"), ("method", "method", "s"),
        ("tree", "tree", "s"), ("precision", "precision", "s"),
        ("tok/s (median)", "decode_tokens_per_s", ".0f"), ("spread", "spread_tokens_per_s", ".0f"),
        ("tokens/iter", "tokens_per_iteration", ".2f"), ("degeneration", "degeneration", ".2f"),
        ("step ms", "step_ms", ".2f"), ("x floor", "ratio_to_floor", ".2f"),
    ]))


if __name__ == "__main__":
    main()
