"""`python -m jaxspec.tune`: choose (gamma, ratio) per method for a model and a prompt set, on this device.

The tuning steps of the Vegas paper:
  1. sweep the ratio at a large gamma until tokens per iteration stabilise (the smallest ratio within
     `--tolerance` of the best tokens per iteration);
  2. sweep gamma at that ratio for decode throughput;
  3. re-adjust the ratio at that gamma for decode throughput;
  4. with `--trees`, measure each draft-tree shape at that ratio and keep it if it beats the chain.
n-gram lookup has no ratio (steps 2 and 4 only). The choice is printed and saved as JSON, which
`python -m jaxspec.generate --method M --tuned FILE` reads (`decoding.spec.load_tuned`). Ratios share one
compilation per gamma.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec import corpus, files
from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec.runner import Batch, encode_prompts, prefill_fn, read_prompt, resolve_max_len, run_generation
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SPARSE_METHODS, spec_from_settings
from jaxspec.decoding.tree import TreeShape
from jaxspec.xla_flags import set_gpu_flags

RATIOS = (0.02, 0.03, 0.05, 0.07, 0.1, 0.15)
GAMMAS = (2, 4, 6, 8, 10)


class Tuner:
    """Measures one batch under many (method, gamma, ratio), from one shared prefill."""

    def __init__(self, params, cfg, batch: Batch, max_new_tokens: int, backend: str, sampling: SamplingConfig, k_max: int):
        self.params, self.cfg, self.batch, self.max_new = params, cfg, batch, max_new_tokens
        self.backend, self.sampling, self.k_max = backend, sampling, k_max
        self.max_len = int(batch.lengths.max()) + max_new_tokens
        prefill = prefill_fn(cfg, self.max_len, backend, 256)
        self.cache = prefill(params, jnp.asarray(batch.ids), jnp.asarray(batch.lengths))
        self.log: list[dict] = []

    def measure(self, method: str, gamma: int, ratio: float | None, tree: TreeShape | None = None) -> dict:
        spec = spec_from_settings(method, gamma=gamma, ratio=ratio, k_max=self.k_max, backend=self.backend,
                                  tree=tree and tree.branching, traversal=tree and tree.order)
        run = run_generation(
            self.params, self.cfg, self.batch, spec=spec, sampling=self.sampling, max_len=self.max_len,
            max_new_tokens=self.max_new, stop_ids=(), cache=jax.tree.map(jnp.copy, self.cache),
        )
        stats = jax.device_get(run.output.stats)
        iterations = max(int(stats.iterations.sum()), 1)
        decode_tokens = int((run.output.length - run.output.prompt_len).sum()) - len(self.batch.lengths)
        row = {
            "method": method, "gamma": spec.draft_len, "ratio": ratio,
            "tree": spec.describe()["tree"], "traversal": spec.describe()["traversal"],
            "tokens_per_iteration": (int(stats.accepted.sum()) + iterations) / iterations,
            "tokens_per_s": decode_tokens / run.decode_s,
        }
        print(json.dumps(row), flush=True)
        self.log.append(row)
        return row


def tune_method(tuner: Tuner, method: str, ratios, gammas, large_gamma: int, tolerance: float, trees=()) -> dict:
    fastest = lambda rows: max(rows, key=lambda r: r["tokens_per_s"])
    if method == "plain":
        return tuner.measure("plain", 1, None)
    if method == "ngram":
        chain = fastest([tuner.measure(method, g, None) for g in gammas])
    else:
        sweep = [tuner.measure(method, large_gamma, r) for r in ratios]
        best_tpi = max(r["tokens_per_iteration"] for r in sweep)
        ratio = min(r["ratio"] for r in sweep if r["tokens_per_iteration"] >= (1 - tolerance) * best_tpi)
        by_gamma = [tuner.measure(method, g, ratio) for g in gammas]
        gamma = fastest(by_gamma)["gamma"]
        chain = fastest([r for r in by_gamma if r["gamma"] == gamma] + [tuner.measure(method, gamma, r) for r in ratios])
    return fastest([chain] + [tuner.measure(method, tree.depth, chain["ratio"], tree) for tree in trees])


def parse_tree(text: str) -> TreeShape:
    """'3,2,1' (BFS) or 'dfs:2,2,2'."""
    order, _, shape = text.rpartition(":")
    return TreeShape.parse(shape, order or "bfs")


def parse_args(argv):
    floats = lambda s: tuple(float(x) for x in s.split(","))
    ints = lambda s: tuple(int(x) for x in s.split(","))
    gpu = jax.default_backend() == "gpu"
    p = ArgumentParser(prog="python -m jaxspec.tune", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--prompt-file", action="append", default=[], type=Path)
    p.add_argument("--corpus", type=int, nargs=2, metavar=("N", "TOKENS"), default=None,
                   help="N prompts of about TOKENS tokens from jaxspec.corpus (default when no prompt is given: 4 x 2000)")
    p.add_argument("--methods", default=",".join(("plain", *SPARSE_METHODS, "ngram")), type=lambda s: s.split(","))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ratios", type=floats, default=RATIOS)
    p.add_argument("--gammas", type=ints, default=GAMMAS)
    p.add_argument("--large-gamma", type=int, default=None, help="gamma of step 1 (default: the largest of --gammas)")
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--trees", nargs="*", default=[], metavar="SHAPE",
                   help="draft-tree shapes to try after the chain (step 4), e.g. 3,2,1 dfs:2,2,2 5,3+1 "
                        "(traversal: bfs unless prefixed)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    p.add_argument("--backend", choices=("reference", "pallas"), default="pallas" if gpu else "reference")
    p.add_argument("--out", type=Path, default=Path("tuned.json"))
    return p.parse_args(argv)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    for method in args.methods:
        spec_from_settings(method)
        if method == "eagle":
            raise JaxspecError("tune has no ratio or selection to tune for eagle: measure its --gamma and --tree "
                               "with python -m jaxspec.profile --methods eagle")
    for value in (*args.gammas, args.large_gamma or 1):
        spec_from_settings("vegas", gamma=value)
    for value in args.ratios:
        spec_from_settings(ratio=value)
    trees = [parse_tree(text) for text in args.trees]
    sampling = SamplingConfig(temperature=args.temperature)
    if args.max_new_tokens < 1 or (args.corpus and min(args.corpus) < 1) or not 0 <= args.tolerance < 1:
        raise JaxspecError("need --max-new-tokens >= 1, --corpus N TOKENS of at least 1 each and --tolerance in [0, 1)")

    from jaxspec.loaders import load_model

    cfg, params, tokenizer = load_model(args.model, dtype=args.dtype)
    prompts = list(args.prompt) + [read_prompt(p) for p in args.prompt_file]
    if not prompts:
        n, tokens = args.corpus or (4, 2000)
        prompts = [corpus.long_prompt(tokenizer, tokens, offset=9 * i) for i in range(n)]
    batch = encode_prompts(tokenizer, prompts, chat=tokenizer.has_chat_template)
    resolve_max_len(batch, args.max_new_tokens, None, cfg.max_position_embeddings)
    k_max = spec_from_settings(ratio=max(args.ratios), min_tokens=256).capacity(int(batch.lengths.max()) + args.max_new_tokens)
    tuner = Tuner(params, cfg, batch, args.max_new_tokens, args.backend, sampling, k_max)
    large_gamma = args.large_gamma or max(args.gammas)
    chosen = {m: tune_method(tuner, m, args.ratios, args.gammas, large_gamma, args.tolerance, trees) for m in args.methods}
    result = {
        "model": args.model, "device": jax.devices()[0].device_kind, "backend": args.backend, "dtype": args.dtype,
        "prompt_tokens": batch.lengths.tolist(), "max_new_tokens": args.max_new_tokens, "sampling": vars(sampling),
        "methods": chosen, "measurements": tuner.log,
    }
    files.write_text(args.out, json.dumps(result, indent=1))
    print(f"\n{'method':14} {'gamma':>5} {'tree':>12} {'ratio':>6} {'tok/iter':>8} {'tok/s':>8}")
    for method, row in chosen.items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        tree = "-" if row["tree"] is None else f"{row['traversal']}:{row['tree']}"
        print(f"{method:14} {row['gamma']:5d} {tree:>12} {ratio:>6} {row['tokens_per_iteration']:8.2f} {row['tokens_per_s']:8.1f}")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    set_gpu_flags()
    main()
