"""`python -m jaxspec.generate`: batched generation from the command line, with speed and acceptance stats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec.runner import encode_prompts, resolve_max_len, run_generation, summarize
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import METHODS, SpecConfig
from jaxspec.decoding.tree import TreeShape
from jaxspec.tune import load_tuned

DEFAULT_PROMPT = "Explain in a few paragraphs why the sky is blue and why sunsets are red."


def parse_args(argv):
    gpu = jax.default_backend() == "gpu"
    p = ArgumentParser(prog="python -m jaxspec.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | path to a .gguf file | HF directory | orbax checkpoint")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", default=[], type=Path, help="a file holding one prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=None, help="cap on prompt + generated tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: when the model has one)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    p.add_argument("--method", choices=METHODS, default="vegas")
    p.add_argument("--gamma", type=int, default=None, help="draft length of a chain (default 6, or the --tuned choice)")
    p.add_argument("--tree", default=None,
                   help="draft a tree instead of a chain: branching per depth, e.g. 4,2,1,1 (at most 64 verified rows)")
    p.add_argument("--traversal", choices=("bfs", "dfs"), default="bfs", help="flattening order of the --tree nodes")
    p.add_argument("--ratio", type=float, default=None, help="fraction of the context a sparse drafter keeps (default 0.07, or the --tuned choice)")
    p.add_argument("--tuned", type=Path, default=None,
                   help="a file from `python -m jaxspec.tune` (or bench/kv_bound.json): its gamma or tree, ratio and metric for --method")
    p.add_argument("--min-tokens", type=int, default=256, help="least KV entries a sparse drafter keeps")
    p.add_argument("--metric", choices=("weight", "logit"), default=None, help="score of vegas/all_rows/last_accepted (default weight, or the --tuned choice)")
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--backend", choices=("reference", "pallas"), default="pallas" if gpu else "reference")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar on stderr (default: when stderr is a terminal)")
    return p.parse_args(argv)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        raise JaxspecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    tuned = load_tuned(args.tuned, args.method) if args.tuned else {}
    gamma = args.gamma if args.gamma is not None else tuned.get("gamma") or 6
    ratio = args.ratio if args.ratio is not None else tuned.get("ratio") or 0.07
    metric = args.metric or tuned.get("metric") or "weight"
    tree, traversal = None, args.traversal
    if args.tree is not None:
        tree = TreeShape.parse(args.tree).branching
    elif args.gamma is None and tuned.get("tree"):  # the tuned tree, unless the flags ask for a chain
        tree, traversal = TreeShape.parse(tuned["tree"]).branching, tuned.get("traversal") or "bfs"
    spec = SpecConfig(
        method=args.method, gamma=gamma, tree=tree, traversal=traversal, ratio=ratio, min_tokens=args.min_tokens,
        metric=metric, ngram_min=args.ngram_min, ngram_max=args.ngram_max, backend=args.backend,
    ).validate()
    prompts = list(args.prompt) + [_read_prompt(path) for path in args.prompt_file]
    prompts = prompts or [DEFAULT_PROMPT]

    from jaxspec.loaders import load_model

    cfg, params, tokenizer = load_model(args.model, dtype=args.dtype)
    chat = tokenizer.has_chat_template if args.chat is None else args.chat
    if chat and not tokenizer.has_chat_template:
        raise JaxspecError(f"--chat: model {args.model} has no chat template")
    batch = encode_prompts(tokenizer, prompts, chat)
    max_len = resolve_max_len(batch, args.max_new_tokens, args.max_len, cfg.max_position_embeddings)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    run = run_generation(
        params, cfg, batch, spec=spec, sampling=sampling, max_len=max_len, max_new_tokens=args.max_new_tokens,
        stop_ids=tokenizer.eos_token_ids, seed=args.seed, progress=progress,
    )
    stats = summarize(run, batch, spec)
    results = [
        {"prompt_tokens": int(n), "tokens": [int(t) for t in g], "text": tokenizer.decode(g, skip_special_tokens=True)}
        for n, g in zip(batch.lengths, run.generated())
    ]
    if args.json:
        print(json.dumps({"model": args.model, "results": results, "stats": stats}))
    else:
        _print_human(results, stats)


def _read_prompt(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise JaxspecError(f"cannot read prompt file {path}: {e}") from None


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
    print(f"compile          {stats['compile_s']:.1f} s (not in the rates above)")
    memory = next(k for k in stats if k.startswith("peak_"))
    print(f"{memory.removesuffix('_bytes').replace('_', ' '):16} {stats[memory] / 2**20:.0f} MiB")
    print(f"method           {stats['method']} (backend {stats['backend']}, device {stats['device']})")
    if stats["gamma"]:
        drafts = f"tree {stats['tree']} ({stats['traversal']})" if stats["tree"] else f"gamma {stats['gamma']}"
        print(f"drafts           {drafts}, {stats['nodes']} nodes" + (f", ratio {stats['ratio']}" if stats["ratio"] else "")
              + (f", metric {stats['metric']}" if stats["metric"] else ""))
        print(f"iterations       {stats['iterations']}, {stats['tokens_per_iteration']:.2f} tokens/iteration")
        rates = " ".join(f"{r:.2f}" for r in stats["acceptance_rate_by_depth"])
        print(f"acceptance       {stats['accepted_tokens']} of {stats['draft_tokens']} nodes verified; by depth {rates}")


if __name__ == "__main__":
    main()
