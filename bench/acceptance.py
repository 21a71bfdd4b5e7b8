"""Acceptance of every sparse drafter on SmolLM2 with real long prompts, at equal budgets.

    PYTHONPATH=. python3 bench/acceptance.py [--ratios 0.03,0.07,0.15] [--gammas 4,6,8]
                                             [--methods ...] [--samplings greedy,t0.6] [--new 256]
                                             [--tiny] [--out DIR] [--resume] [--report FILE]

Prompts of 2K-7K tokens are documents from `jaxspec.corpus` plus a question, a summary request or a
continuation request, run as one batch through the chat template; each method drafts 256 new tokens
per prompt. Reported per (sampling, method, gamma, ratio): tokens per iteration (accepted + 1) and
the acceptance rate by draft position. `min_tokens` is 16 so that the budget is ratio x context for
every method (the default floor of 256 would hide the ratio at these lengths). Ratios share one
compilation (the selection capacity is fixed at the largest ratio). Writes DIR/acceptance.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from jaxspec import corpus
from jaxspec.runner import encode_prompts, prefill_fn, run_generation
from jaxspec.loaders import load_model
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig, spec_from_settings

PROMPTS = [(2000, "question", 0), (3000, "continue", 9), (4000, "summary", 18), (5000, "question", 27), (6000, "continue", 36), (7000, "question", 45)]
SAMPLINGS = {"greedy": SamplingConfig(), "t0.6": SamplingConfig(temperature=0.6, top_p=0.95, top_k=20)}
MIN_TOKENS = 16


def measure(params, cfg, batch, cache, spec, sampling, max_len, new) -> dict:
    run = run_generation(
        params, cfg, batch, spec=spec, sampling=sampling, max_len=max_len, max_new_tokens=new, stop_ids=(),
        cache=jax.tree.map(jnp.copy, cache),
    )
    stats = jax.device_get(run.output.stats)
    iterations = int(stats.iterations.sum())
    return {
        "tokens_per_iteration": (int(stats.accepted.sum()) + iterations) / iterations,
        "acceptance_by_depth": (stats.accepted_by_depth.sum(0) / iterations).tolist(),
        "iterations": iterations,
        "decode_s": run.decode_s,
        "compile_s": run.compile_s,
    }


def parse_args():
    floats = lambda s: [float(x) for x in s.split(",")]
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratios", default="0.03,0.07,0.15", type=floats)
    p.add_argument("--gammas", default="4,6,8", type=ints)
    p.add_argument("--methods", default="vegas,all_rows,last_accepted,stream,quest", type=lambda s: [m for m in s.split(",") if m],
                   help="sparse methods; ngram (no ratio) always runs once per sampling and gamma")
    p.add_argument("--samplings", default="greedy,t0.6", type=lambda s: s.split(","))
    p.add_argument("--new", default=256, type=int, help="tokens generated per prompt")
    p.add_argument("--backend", default="pallas" if jax.default_backend() == "gpu" else "reference")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tiny", action="store_true", help="two short prompts, 16 tokens: a smoke test of this script")
    p.add_argument("--out", default=str(common.RESULTS))
    p.add_argument("--resume", action="store_true", help="keep the rows already in DIR/acceptance.json and skip their configurations")
    p.add_argument("--report", type=Path, help="print the tables of an acceptance.json and exit")
    return p.parse_args()


def main():
    args = parse_args()
    if args.report:
        print(report(json.loads(args.report.read_text())["rows"]))
        return
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    cfg, params, tokenizer = load_model(args.model, dtype=dtype)
    prompts = [(300, "question", 0), (500, "continue", 9)] if args.tiny else PROMPTS
    new = 16 if args.tiny else args.new
    batch = encode_prompts(tokenizer, [corpus.long_prompt(tokenizer, n, task, offset) for n, task, offset in prompts], chat=True)
    max_len = int(batch.lengths.max()) + new
    start = time.perf_counter()
    cache = jax.block_until_ready(prefill_fn(cfg, max_len, args.backend, 256)(params, jnp.asarray(batch.ids), jnp.asarray(batch.lengths)))
    print(f"prefill of {batch.lengths.tolist()} tokens: {time.perf_counter() - start:.1f} s", flush=True)
    k_max = SpecConfig(ratio=max(args.ratios), min_tokens=MIN_TOKENS).capacity(max_len)

    result = common.run_info() | {
        "model": args.model, "dtype": dtype, "prompt_tokens": batch.lengths.tolist(), "new_tokens": new,
        "min_tokens": MIN_TOKENS, "k_max": k_max, "rows": [],
    }
    path = Path(args.out) / ("acceptance_tiny.json" if args.tiny else "acceptance.json")
    if args.resume and path.exists():
        earlier = json.loads(path.read_text())
        if (earlier["prompt_tokens"], earlier["new_tokens"], earlier["dtype"]) != (result["prompt_tokens"], new, dtype):
            raise SystemExit(f"{path} holds another workload: not resuming it")
        result["rows"] = earlier["rows"]
    done = {(r["sampling"], r["method"], r["gamma"], r["ratio"]) for r in result["rows"]}
    configs = [(s, m, g, r) for s in args.samplings for g in args.gammas for m in args.methods for r in args.ratios]
    configs += [(s, "ngram", g, None) for s in args.samplings for g in args.gammas]
    for sampling, method, gamma, ratio in [c for c in configs if c not in done]:
        spec = spec_from_settings(method, gamma=gamma, ratio=ratio or 0.07, min_tokens=MIN_TOKENS, k_max=k_max, backend=args.backend)
        row = {"sampling": sampling, "method": method, "gamma": gamma, "ratio": ratio}
        row |= measure(params, cfg, batch, cache, spec, SAMPLINGS[sampling], max_len, new)
        print(row, flush=True)
        result["rows"].append(row)
        common.write_json(path, result)
    print(report(result["rows"]))


def report(rows: list[dict]) -> str:
    """The table, then the paper's orderings per sampling (greedy outputs are the same text for every
    method; sampled ones differ, so their comparisons carry that noise too)."""
    parts = [table(rows)]
    for sampling in sorted({r["sampling"] for r in rows}):
        parts += [f"{sampling}:", orderings([r for r in rows if r["sampling"] == sampling])]
    return "\n\n".join(parts)


def table(rows: list[dict]) -> str:
    """Tokens per iteration: one line per (sampling, method, ratio), one column per gamma."""
    gammas = sorted({r["gamma"] for r in rows})
    lines = ["| sampling | method | ratio | " + " | ".join(f"γ={g}" for g in gammas) + " |", "|---|---|---|" + "---|" * len(gammas)]
    keys = sorted({(r["sampling"], r["method"], r["ratio"] or 0) for r in rows}, key=lambda k: (k[0], k[2], k[1]))
    for sampling, method, ratio in keys:
        cells = []
        for g in gammas:
            match = [r for r in rows if (r["sampling"], r["method"], r["ratio"] or 0, r["gamma"]) == (sampling, method, ratio, g)]
            cells.append(f"{match[0]['tokens_per_iteration']:.2f}" if match else "-")
        lines.append(f"| {sampling} | {method} | {ratio or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The paper's claims at equal budget: (a, b, relation); "~" means within 2% of b's tokens per iteration.
CLAIMS = [("vegas", "all_rows", "~"), ("vegas", "last_accepted", ">"), ("quest", "stream", ">"), ("vegas", "stream", ">"), ("vegas", "quest", ">")]


def orderings(rows: list[dict]) -> str:
    """For each claim, in how many (sampling, gamma, ratio) configurations it holds, and the margins."""
    tpi = {(r["sampling"], r["method"], r["gamma"], r["ratio"]): r["tokens_per_iteration"] for r in rows}
    lines = ["| claim | holds in | margin (a - b tokens/iteration) min / median / max |", "|---|---|---|"]
    for a, b, relation in CLAIMS:
        margins, holds = [], 0
        for (sampling, method, gamma, ratio), value in sorted(tpi.items(), key=str):
            other = tpi.get((sampling, b, gamma, ratio))
            if method != a or other is None:
                continue
            margins.append(value - other)
            holds += abs(value - other) <= 0.02 * other if relation == "~" else value > other
        if margins:
            lines.append(f"| {a} {relation} {b} | {holds}/{len(margins)} | {min(margins):+.2f} / {statistics.median(margins):+.2f} / {max(margins):+.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
