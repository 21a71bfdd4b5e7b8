"""Engine losslessness with the Pallas backend on the GPU (teacher-forced, bf16).

    PYTHONPATH=. python3 bench/gpu_checks.py [--model qwen3-8b|nsa-1b|qwen3-30b-a3b|gpt-oss-20b|smollm2|PATH] [--context N] [--new N]
        [--tree 3,2,1 [--traversal dfs]] [--draft-model DIR] [--dtype float32] [--route-all] [--layers N]
        [--backend reference] [--experts mxfp4|mxfp4-words|mxfp4-scale-words [--exact-decode]] [--tiny] [--out DIR]

For each method, generate greedily with the pallas backend, then run one full forward (reference
attention) over prompt + output: every emitted token must be the argmax of its prefix's logits, up
to bf16 near-ties between the top two logits (docs/architecture.md, "The speculative-decoding
contract"). Qwen3-8B, NSA-1B (bench/nsa.py's, NSA kernels included), Qwen3-30B-A3B and gpt-oss-20b
shapes (the experts kernel, sinks and sliding windows included) use random weights and a prompt of
random tokens; SmolLM2 uses a real long prompt. Method eagle drafts with --draft-model, else
the head shipped for the model (smollm2's), else a random head at the model's shapes (the check does
not need a good head); a model with too few layers for a head skips it.
Methods draft chains of 6, or the draft tree of --tree. `--dtype float32` and `--layers N` (random-weight
models) tell a kernel or cache error from bf16 rounding that random weights amplify with depth: gpt-oss-20b's
shapes at 12 layers fail this check in bf16 with the reference kernels and pass in float32 (CPU,
bench/NOTES.md). `--dtype float32` multiplies in full float32 (JAX's default on the GPU is TF32).
`--route-all` routes every token to every expert, so no router near-tie turns rounding into another
expert. At 24 layers random gpt-oss weights amplify even float32 rounding past the near-ties, routed
or not (bench/NOTES.md): there the check to read is every method emitting plain's tokens (when plain runs first, as by
default, each other row records `equals_plain`; every row records its emitted tokens, and whether the
full forward's logits were finite). `--exact-decode`: the MXFP4 kernels decode the codes by
`mxfp4.exact_values`, not by placing their bits (`mxfp4.PLACED_DECODE`, the default). Writes
DIR/gpu_checks_<model>[_tree][_float32][_route_all][_mxfp4|_mxfp4-words|_mxfp4-scale-words][_exact][_reference].json.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec import corpus
from jaxspec.errors import JaxspecError
from jaxspec.loaders.eagle import load_eagle, shipped_head
from jaxspec.models import decoder
from jaxspec.runner import Batch, encode_prompts, prefill_fn, run_generation
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import METHODS, spec_from_settings
from jaxspec.decoding.tree import TreeShape
from pallas_kernels import mxfp4

NEAR_TIE = 0.05  # bf16 logits: the emitted token may trail the argmax by this much (relative)


def teacher_forced(params, cfg, batch: Batch, generated: list[np.ndarray]) -> dict:
    """Fraction of emitted tokens that are the exact argmax, and whether all are within a near-tie."""
    exact, within, total, finite = 0, True, 0, True
    for b, out in enumerate(generated):
        full = np.concatenate([batch.ids[b, : batch.lengths[b]], out])
        logits = np.asarray(decoder.score(params, cfg, jnp.asarray(full[None])), np.float32)[0]
        predicted = logits[batch.lengths[b] - 1 : -1]
        finite &= bool(np.isfinite(predicted).all())
        top = predicted.max(-1)
        chosen = predicted[np.arange(len(out)), out]
        exact += int((chosen == top).sum())
        within &= bool(np.all(chosen >= top - NEAR_TIE * np.maximum(1.0, np.abs(top))))
        total += len(out)
    return {"exact_argmax_fraction": exact / total, "all_within_near_tie": within, "tokens": total,
            "finite_logits": finite, "generated": [out.tolist() for out in generated]}


RANDOM_MODELS = ("qwen3-8b", "nsa-1b", "qwen3-30b-a3b", "gpt-oss-20b")  # checked with random weights


def random_model_config(name: str, tiny: bool):
    """The shapes of a model checked with random weights, or small ones of its kind (--tiny: MoE
    models at eight layers (an EAGLE-3 head needs seven), gpt-oss's every other one sliding, 8 experts of 64
    with 2 routed a row)."""
    from bench.decode import TINY_CFG
    from bench.nsa import NSA_1B, TINY_1B

    real = {"qwen3-8b": common.QWEN3_8B, "nsa-1b": NSA_1B, "qwen3-30b-a3b": common.QWEN3_30B_A3B,
            "gpt-oss-20b": common.GPT_OSS_20B}[name]
    if not tiny:
        return real
    if real.moe is None:
        return {"qwen3-8b": TINY_CFG, "nsa-1b": TINY_1B}[name]
    return dataclasses.replace(real, vocab_size=1024, hidden_size=128, num_layers=8, num_heads=8, num_kv_heads=2,
                               head_dim=64, intermediate_size=64, sliding_window=real.sliding_window and 32,
                               sliding_layers=real.sliding_layers and (0, 2, 4, 6),
                               moe=dataclasses.replace(real.moe, num_experts=8, top_k=2, expert_size=64))


def with_head(params, cfg, path: Path | None):
    """(the head's config, params with the head under "eagle"): the head at `path`, else a random one at
    the model's shapes; (None, params) when the model has too few layers for a head."""
    if path is not None:
        head, head_params = load_eagle(path, cfg, "bfloat16")
    else:
        try:
            head, head_params = common.random_head(cfg)
        except JaxspecError as e:
            print(f"eagle skipped: {e}")
            return None, params
    return head, {**params, "eagle": jax.device_put(head_params)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","))
    p.add_argument("--backend", default="pallas", help="pallas, or reference to tell kernel errors from bf16 effects")
    p.add_argument("--tree", default=None, help="draft this tree (e.g. 3,2,1) instead of a chain of 6")
    p.add_argument("--traversal", default="bfs")
    p.add_argument("--draft-model", type=Path, default=None, help="method eagle's head")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="random-weight models' weights and cache")
    p.add_argument("--layers", type=int, default=None, help="random-weight models: this many layers")
    p.add_argument("--route-all", action="store_true",
                   help="random-weight MoE models: route every token to every expert (no router near-ties to flip)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--experts", choices=common.EXPERT_FORMS, default="bf16", help=common.EXPERT_FORMS_HELP)
    p.add_argument("--exact-decode", action="store_true",
                   help="MXFP4 experts: decode their codes in the kernels by mxfp4.exact_values "
                        "(not mxfp4.PLACED_DECODE)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    mxfp4.PLACED_DECODE = not args.exact_decode
    if args.dtype == "float32":  # XLA and Triton multiply float32 in TF32 by default on the GPU
        jax.config.update("jax_default_matmul_precision", "highest")
    backend = args.backend
    if args.model in RANDOM_MODELS:
        cfg = dataclasses.replace(random_model_config(args.model, args.tiny), dtype=args.dtype)
        if args.layers:
            cfg = dataclasses.replace(cfg, num_layers=args.layers, sliding_layers=tuple(i for i in cfg.sliding_layers
                                                                                         if i < args.layers))
        if args.route_all and cfg.moe is not None:
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, top_k=cfg.moe.num_experts))
        params = decoder.init_params(cfg, jax.random.key(0), scale=0.05)
        if args.experts != "bf16":
            params = common.with_mxfp4_experts(params, args.experts)
        ids, lengths = common.random_prompts(cfg, 2, args.context)
        lengths[1] = args.context - 1000 if args.context > 2000 else args.context // 2
        batch = Batch(ids, lengths)
    else:
        from jaxspec.loaders import load_model

        cfg, params, tokenizer = load_model(args.model, dtype="bfloat16")
        prompts = [corpus.long_prompt(tokenizer, args.context, offset=5), corpus.long_prompt(tokenizer, args.context // 2, task="continue")]
        batch = encode_prompts(tokenizer, prompts, chat=True)
    max_len = int(batch.lengths.max()) + args.new
    head = None
    if "eagle" in args.methods:
        head, params = with_head(params, cfg, args.draft_model or shipped_head(args.model))
        if head is None:
            args.methods = [m for m in args.methods if m != "eagle"]
    cache = prefill_fn(cfg, max_len, backend, 256, head)(params, jnp.asarray(batch.ids), jnp.asarray(batch.lengths))
    result = common.run_info() | {"model": args.model, "backend": backend, "prompt_tokens": batch.lengths.tolist(), "rows": []}
    tree = None if args.tree is None else TreeShape.parse(args.tree).branching
    for method in args.methods:
        spec = spec_from_settings(method, gamma=6, tree=tree if method != "plain" else None, traversal=args.traversal, ratio=0.07,
                                  min_tokens=64, backend=backend, eagle=head if method == "eagle" else None)
        run = run_generation(params, cfg, batch, spec=spec, sampling=SamplingConfig(), max_len=max_len,
                             max_new_tokens=args.new, stop_ids=(), cache=jax.tree.map(jnp.copy, common.cache_for(spec, cache)))
        stats = jax.device_get(run.output.stats)
        row = {"method": method, "tree": spec.describe()["tree"], "traversal": spec.describe()["traversal"], **teacher_forced(params, cfg, batch, run.generated()),
               "tokens_per_iteration": float((stats.accepted.sum() + stats.iterations.sum()) / max(stats.iterations.sum(), 1))}
        if result["rows"] and result["rows"][0]["method"] == "plain":
            row["equals_plain"] = row["generated"] == result["rows"][0]["generated"]
        print(row, flush=True)
        result["rows"].append(row)
    tag = "" if tree is None else f"_tree{args.traversal}{args.tree.replace(',', '')}"
    tag += ("" if args.dtype == "bfloat16" else f"_{args.dtype}") + ("_route_all" if args.route_all else "")
    tag += ("" if args.experts == "bf16" else f"_{args.experts}") + ("_exact" if args.exact_decode else "")
    tag += "" if backend == "pallas" else f"_{backend}"
    common.write_json(args.out / f"gpu_checks_{Path(args.model).stem}{tag}.json", result)
    ok = all(r["all_within_near_tie"] for r in result["rows"])
    print(("PASS" if ok else "FAIL") + f": teacher-forced check, {args.model}, {backend} backend")
    compared = [r for r in result["rows"] if "equals_plain" in r]
    if compared:
        same = [r["method"] for r in compared if r["equals_plain"]]
        print(f"{len(same)} of {len(compared)} methods emit plain's tokens: {', '.join(same) or 'none'}")


if __name__ == "__main__":
    main()
