"""NSA-SmolLM2 against dense SmolLM2: held-out perplexity, top-1 agreement, and continuations to read.

    PYTHONPATH=. python3 bench/nsa_quality.py [--nsa checkpoints/nsa-smollm2] [--dense smollm2]
        [--contexts 2048,7168] [--windows N] [--chunk 2048] [--new 100] [--prompt-tokens 4096]
        [--dtype float32] [--tiny] [--out DIR]

Held-out text: the documents of `jaxspec.corpus` that the gate fit never sees
(`training.data.split_documents`), cut into consecutive windows of each context length. Each window is
scored teacher-forced by both models (the NSA model through its own NSA attention, `decoder.forward`
over a KV cache in chunks of --chunk tokens, which equals `decoder.score` on the whole window):
perplexity over every position and over the window's second half (the positions with the longest
context), top-1 agreement (NSA's argmax = dense's argmax) and the mean KL(dense || NSA). Then a greedy
and a sampled (T 0.7, top-p 0.95) continuation of --new tokens of one long held-out prompt (raw text, no
chat template) from each model, beside the text's true continuation, so a reader can judge coherence.
Writes DIR/nsa_quality_<nsa dir name>.json; prints the continuations, then the table last.

CPU smoke run: --tiny (contexts 256 and 512, 2 windows, chunks of 128, 16 new tokens, a 300-token prompt).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import spec_from_settings
from jaxspec.loaders import load_model
from jaxspec.models import decoder
from jaxspec.models.config import nsa_hf_keys
from jaxspec.models.kvcache import init_cache
from jaxspec.runner import Batch, run_generation
from jaxspec.training import data, nsa_gates

SAMPLINGS = {"greedy": SamplingConfig(), "sampled": SamplingConfig(temperature=0.7, top_p=0.95)}


@functools.lru_cache(maxsize=None)
def chunk_fn(cfg, chunk: int, backend: str):
    """logits [1, chunk, V] of tokens [1, chunk] at positions start.., written into the donated cache."""

    def run(params, cache, tokens, start, length):
        pos = start + jnp.arange(chunk, dtype=jnp.int32)[None]
        valid = pos < length
        hidden, cache, _ = decoder.forward(params, cfg, tokens, pos, valid, cache, decoder.attention(cfg, pos, backend),
                                           backend=backend)
        return decoder.logits(params, cfg, hidden), cache

    return jax.jit(run, donate_argnums=1)


@jax.jit
def chunk_stats(dense_logits, nsa_logits, targets, weight):
    """Per-position sums for one chunk: NLL of each model, top-1 agreement, KL(dense || NSA)."""
    ld = jax.nn.log_softmax(dense_logits[0], axis=-1)
    ln = jax.nn.log_softmax(nsa_logits[0], axis=-1)
    nll = lambda lp: -jnp.take_along_axis(lp, targets[0][:, None], axis=-1)[:, 0]
    agree = (jnp.argmax(ld, -1) == jnp.argmax(ln, -1)).astype(jnp.float32)
    kl = jnp.sum(jnp.exp(ld) * (ld - ln), axis=-1)
    w = weight[0]
    return jnp.stack([jnp.sum(w * nll(ld)), jnp.sum(w * nll(ln)), jnp.sum(w * agree), jnp.sum(w * kl), jnp.sum(w)])


def window_stats(models, window: np.ndarray, chunk: int, backend: str) -> np.ndarray:
    """[2 halves, 5] sums (NLL dense, NLL NSA, agreements, KL, positions) over one window; position t
    predicts token t + 1; half 1 is t >= T / 2."""
    T = len(window)
    chunk = min(chunk, T)
    n = -(-T // chunk)
    padded = np.zeros(n * chunk + 1, np.int32)
    padded[:T] = window
    caches = [init_cache(cfg, 1, n * chunk) for cfg, _ in models]
    sums = np.zeros((2, 5))
    for i in range(n):
        start = i * chunk
        tokens = jnp.asarray(padded[None, start : start + chunk])
        out = []
        for m, (cfg, params) in enumerate(models):
            logits, caches[m] = chunk_fn(cfg, chunk, backend)(params, caches[m], tokens, jnp.int32(start), jnp.int32(T))
            out.append(logits)
        pos = start + np.arange(chunk)
        targets = jnp.asarray(padded[None, start + 1 : start + chunk + 1])
        for half in (0, 1):
            weight = (pos < T - 1) & ((pos >= T // 2) if half else (pos < T // 2))
            if weight.any():
                sums[half] += np.asarray(chunk_stats(out[0], out[1], targets, jnp.asarray(weight[None], jnp.float32)))
    return sums


def quality_row(models, windows: np.ndarray, chunk: int, backend: str) -> dict:
    start = time.perf_counter()
    sums = sum(window_stats(models, w, chunk, backend) for w in windows)
    total = sums.sum(axis=0)

    def summary(s):
        return {"ppl_dense": float(np.exp(s[0] / s[4])), "ppl_nsa": float(np.exp(s[1] / s[4])),
                "top1_agreement": float(s[2] / s[4]), "kl": float(s[3] / s[4]), "positions": int(s[4])}

    full, late = summary(total), summary(sums[1])
    return {"context": int(windows.shape[1]), "windows": int(windows.shape[0]), **full,
            **{f"{k}_2nd_half": v for k, v in late.items() if k != "positions"}, "seconds": time.perf_counter() - start}


def prompt_ids(tokenizer, tokens: int, new: int) -> tuple[np.ndarray, np.ndarray]:
    """A held-out prompt of at most `tokens` tokens ending at a line break, and the `new` tokens that
    follow it in the text."""
    stream = data.token_stream(tokenizer, data.split_documents()[1])
    end = min(tokens, len(stream) - new)
    while end > tokens // 2 and "\n" not in tokenizer.decode([int(stream[end - 1])]):
        end -= 1
    return stream[:end], stream[end : end + new]


def continuations(name, cfg, params, tokenizer, prompt: np.ndarray, new: int, backend: str, seed: int) -> dict:
    batch = Batch(prompt[None].astype(np.int32), np.asarray([len(prompt)], np.int32))
    out = {}
    for kind, sampling in SAMPLINGS.items():
        run = run_generation(params, cfg, batch, spec=spec_from_settings("plain", backend=backend),
                             sampling=sampling, max_len=len(prompt) + new, max_new_tokens=new,
                             stop_ids=cfg.eos_token_ids, seed=seed)
        ids = run.generated()[0].tolist()
        out[kind] = {"text": tokenizer.decode(ids), "tokens": len(ids), "decode_s": run.decode_s}
        print(f"\n--- {name}, {kind} ---\n{out[kind]['text']}", flush=True)
    return out


def gate_info(path: str) -> dict | None:
    gates = Path(path) / nsa_gates.GATES_FILE
    if not gates.is_file():
        return None
    info = nsa_gates.load_gates(gates)[1]
    fingerprint = info.get("data", {}).get("heldout_sha256_16")
    if fingerprint and fingerprint != data.heldout_fingerprint():
        print(f"warning: the gates were fitted with other held-out documents ({fingerprint}, here "
              f"{data.heldout_fingerprint()}): another Python's pydoc topics? Held-out numbers may include training text.")
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nsa", default="checkpoints/nsa-smollm2", help="python -m jaxspec.convert smollm2 DST --to-nsa")
    p.add_argument("--dense", default="smollm2")
    p.add_argument("--contexts", default="2048,7168", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--windows", type=int, default=None, help="at most this many windows per context (default: all)")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per scoring pass (memory)")
    p.add_argument("--new", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--backend", default=None, help="attention kernels (default: pallas on a GPU, else reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (short contexts, few tokens)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    if args.tiny:
        args.contexts, args.windows, args.chunk, args.new, args.prompt_tokens = [256, 512], 2, 128, 16, 300
    backend = args.backend or ("pallas" if jax.default_backend() == "gpu" else "reference")

    dense_cfg, dense_params, tokenizer = load_model(args.dense, args.dtype)
    nsa_cfg, nsa_params, nsa_tokenizer = load_model(args.nsa, args.dtype)
    if nsa_cfg.nsa is None:
        raise SystemExit(f"error: {args.nsa} is not an NSA model ({nsa_cfg.model_type})")
    if nsa_tokenizer.vocab_size != tokenizer.vocab_size or dense_cfg.vocab_size != nsa_cfg.vocab_size:
        raise SystemExit("error: the two models have different vocabularies")
    result = common.run_info() | {
        "dense": args.dense, "nsa": args.nsa, "dtype": args.dtype, "backend": backend,
        "nsa_config": nsa_hf_keys(nsa_cfg.nsa), "gates": gate_info(args.nsa),
        "heldout": {"documents": len(data.split_documents()[1]), "sha256_16": data.heldout_fingerprint()},
        "rows": [],
    }
    models = [(dense_cfg, dense_params), (nsa_cfg, nsa_params)]
    for context in args.contexts:
        if context > min(dense_cfg.max_position_embeddings, nsa_cfg.max_position_embeddings):
            raise SystemExit(f"error: context {context} is longer than the models' context")
        windows = data.heldout_windows(tokenizer, context, args.windows)
        row = quality_row(models, windows, args.chunk, backend)
        result["rows"].append(row)
        print(f"context {context}: {row['windows']} windows, ppl dense {row['ppl_dense']:.2f} NSA {row['ppl_nsa']:.2f}, "
              f"top-1 agreement {row['top1_agreement']:.3f}, KL {row['kl']:.4f} ({row['seconds']:.0f} s)", flush=True)

    prompt, truth = prompt_ids(tokenizer, args.prompt_tokens, args.new)
    result["generation"] = {
        "prompt_tokens": int(len(prompt)), "new_tokens": args.new, "seed": args.seed,
        "prompt_tail": tokenizer.decode(prompt[-200:].tolist()), "true_continuation": tokenizer.decode(truth.tolist()),
    }
    print(f"\n=== prompt: {len(prompt)} held-out tokens, ending ===\n{result['generation']['prompt_tail']}")
    print(f"\n--- the text's own continuation ---\n{result['generation']['true_continuation']}", flush=True)
    for name, (cfg, params) in (("dense", models[0]), ("nsa", models[1])):
        result["generation"][name] = continuations(name, cfg, params, tokenizer, prompt, args.new, backend, args.seed)

    common.write_json(args.out / f"nsa_quality_{Path(args.nsa).name}.json", result)
    print()
    print(common.markdown_table(result["rows"], [
        ("context", "context", "d"), ("windows", "windows", "d"), ("ppl dense", "ppl_dense", ".2f"),
        ("ppl NSA", "ppl_nsa", ".2f"), ("ppl dense 2nd half", "ppl_dense_2nd_half", ".2f"),
        ("ppl NSA 2nd half", "ppl_nsa_2nd_half", ".2f"), ("top-1 agree", "top1_agreement", ".3f"),
        ("top-1 2nd half", "top1_agreement_2nd_half", ".3f"), ("KL", "kl", ".4f"),
    ]))


if __name__ == "__main__":
    main()
