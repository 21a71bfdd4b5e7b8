"""How well EAGLE-3 heads follow their target, teacher-forced, on a few kinds of text (CPU, float32).

    PYTHONPATH=. python3 bench/head_quality.py --heads checkpoints/eagle3-smollm2,DIR [--new 200]
                                               [--window 512] [--texts NAME,...] [--vocab-sizes N,...]
                                               [--request-openers] [--draws]
                                               [--out bench/results/head_quality_cpu.json]

For each text, the target scores it from position 0 and each head runs EAGLE-3's training-time test
over it (`training.eagle.ttt_loss`, the training loss's own accuracy): the share of positions where
the head's top draft token, mapped to target ids, is the target's argmax, at draft depths 1-3 (depths
2 and 3 fed the true tokens), and the share where that argmax is in the head's draft vocabulary at
all (`in draft vocabulary`: the head can draft nothing else). It measures a head without timing
anything, so heads trained elsewhere compare on one machine. The texts:
- `default greedy` / `default sampled`: `generate`'s default request, chat-templated, and the
  target's own answer (greedy; T 0.7, top-p 0.95, seed 0), `--new` tokens;
- `chat turns`: a prompt of 12 identical chat turns and the target's greedy continuation past its
  turn's end (text that repeats itself exactly: a head that knows chat's structure drafts it well);
- `held-out documents`: two windows of `--window` (512) tokens of the held-out documents
  (`training.data`); a long window scores a head where the target's context is long;
- `document continuation`: `bench/e2e.py --heldout`'s kind of prompt (held-out documents, `--window`
  tokens, a continuation request, chat template) and the target's greedy continuation, `--new` tokens
  without stopping: the text an end-to-end run drafts, which loops where the written documents do not;
- `fresh data`: data of the shipped head's recipe that no head has seen (`training.eagle.self_distill`,
  seed 99, chat share 0.8, cut loops, FRESH_TOKENS in windows of `--window`; `--request-openers`: its
  requests begun with `training.eagle.OPENERS`), so a head's figure here against its training log's
  is what it memorised.
With `--draws` it also gives each depth's chance of acceptance when the target samples, with top draws
and with sampled draws (`draw_acceptance`): which of eagle's two ways to pick children drafts better.
It also prints, per text, what a perfect head could reach there with top draws when the target samples
(`target_bound`): the target's own top-1 probability bounds it, whatever head drafts; and with
`--vocab-sizes`, how much of the target's argmax draft vocabularies of those sizes would hold
(`vocabulary_coverage`: the training documents' most frequent tokens, as a head trained on them gets).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec.decoding.sampling import SamplingConfig, process_logits
from jaxspec.decoding.spec import SpecConfig
from jaxspec.generate import DEFAULT_PROMPT
from jaxspec.loaders import load_model
from jaxspec.loaders.eagle import load_eagle
from jaxspec.models import decoder, eagle
from jaxspec.runner import Batch, run_generation
from jaxspec.training import data
from jaxspec.training.eagle import draft_vocabulary, self_distill, teacher

DEPTHS = 3
TOP_K = 4
CHAT_TURN = ("What is the capital of France?", "The capital of France is Paris.")
TEXTS = ("default greedy", "default sampled", "chat turns", "held-out documents", "document continuation",
         "fresh data")
FRESH_TOKENS = 12000


def answer(params, cfg, tokenizer, prompt: str, new: int, sampling: SamplingConfig,
           stop: bool = True, seed: int = 0) -> tuple[np.ndarray, int]:
    """(the tokens of `prompt`, already templated, followed by the target's own continuation (plain
    decoding, sampled with `seed`; past the end of its turn unless `stop`), the prompt's length)."""
    ids = tokenizer.encode(prompt)
    batch = Batch(np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32))
    run = run_generation(params, cfg, batch, spec=SpecConfig(method="plain", backend="reference").validate(),
                         sampling=sampling, max_len=len(ids) + new, max_new_tokens=new,
                         stop_ids=tokenizer.eos_token_ids if stop else (), seed=seed)
    return np.asarray(ids + [int(t) for t in run.generated()[0]], np.int32), len(ids)


def texts(params, cfg, tokenizer, new: int, window: int, names: list[str], openers: bool = False
          ) -> dict[str, tuple[np.ndarray, int]]:
    """name -> ([N, T] token rows, the first target position scored: the prompt's last, whose
    prediction is the answer's first token), as the module docstring lists, for `names` of TEXTS."""
    template = lambda turns: tokenizer.apply_chat_template(turns, add_generation_prompt=True)
    request = template([{"role": "user", "content": DEFAULT_PROMPT}])
    turns = [{"role": r, "content": c} for _ in range(12) for r, c in zip(("user", "assistant"), CHAT_TURN)]
    sample = SamplingConfig(temperature=0.7, top_p=0.95)
    answers = {"default greedy": (request, SamplingConfig(), True), "default sampled": (request, sample, True),
               "chat turns": (template(turns[:-1]), SamplingConfig(), False)}
    if "document continuation" in names:
        document = common.real_text_prompts(tokenizer, 1, window, heldout=True)[0]
        answers["document continuation"] = (template([{"role": "user", "content": document}]), SamplingConfig(), False)
    rows = {}
    for name, (prompt, sampling, stop) in answers.items():
        if name in names:
            ids, first = answer(params, cfg, tokenizer, prompt, new, sampling, stop)
            rows[name] = (ids[None], first - 1)
    if "held-out documents" in names:
        rows["held-out documents"] = (data.heldout_windows(tokenizer, window, count=2), 0)
    if "fresh data" in names:
        stream = self_distill(cfg, params, tokenizer, FRESH_TOKENS, window, batch=32, seed=99, chat_share=0.8,
                              cut_loops=True, openers=openers)
        rows["fresh data"] = (stream[: len(stream) // window * window].reshape(-1, window), 0)
    return rows


def draw_acceptance(head, ecfg, params, cfg, tokens: jax.Array, outs: list, start: int) -> dict:
    """The chance a depth's draft is accepted when the target samples at T 0.7, top-p 0.95, at each
    position >= `start` of `tokens` [N, T] (depths teacher-forced along the text), averaged: with top
    draws (eagle's default) the target's p of the head's top token; with sampled draws sum min(p, q),
    q the head's distribution after the same processing (one minus their total variation)."""
    rules = SamplingConfig(temperature=0.7, top_p=0.95)
    T = tokens.shape[1]
    ids = eagle.to_target_ids(head["d2t"], jnp.arange(ecfg.draft_vocab_size))
    p = jnp.concatenate([process_logits(decoder.score(params, cfg, row[None]), rules) for row in tokens])[..., ids]
    result = {}
    for k, out in enumerate(outs):
        at = np.arange(T - 1) + k + 1
        rows = (at <= T - 1) & (at >= start)
        logits = eagle.draft_logits(head, ecfg, params, cfg, out)
        p_at = p[:, np.minimum(at, T - 1)]  # the target's processed distribution at each depth-k draft
        top = jnp.take_along_axis(p_at, jnp.argmax(logits, axis=-1)[..., None], axis=-1)[..., 0]
        sampled = jnp.minimum(p_at, process_logits(logits, rules)).sum(axis=-1)
        result[f"depth {k + 1} top"] = round(float(np.asarray(top)[:, rows].mean()), 4)
        result[f"depth {k + 1} sampled"] = round(float(np.asarray(sampled)[:, rows].mean()), 4)
    return result


def accuracy(head_dir: Path, params, cfg, tokens: np.ndarray, start: int, draws: bool = False) -> dict:
    """Agreement with the target's argmax over the target's predictions at positions >= `start` of
    `tokens` [N, T]: the head's top 1 at draft depths 1..DEPTHS, and its top TOP_K at depth 1; with
    `draws`, also `draw_acceptance`."""
    ecfg, head = load_eagle(head_dir, cfg, dtype="float32")
    tokens = jnp.asarray(tokens)
    target = teacher(params, cfg, ecfg, head["d2t"], tokens)  # the target's features and argmax, as training's
    argmax = np.asarray(target.argmax)
    outs = eagle.ttt_forward(head, ecfg, params, cfg, tokens, target.features, DEPTHS)
    T = tokens.shape[1]
    result = {}
    for k in range(DEPTHS):
        at = np.arange(T - 1) + k + 1  # row t's draft at depth k + 1 is scored against the target at t + k + 1
        rows = (at <= T - 1) & (at >= start)
        ranked = np.argsort(-np.asarray(eagle.draft_logits(head, ecfg, params, cfg, outs[k])), axis=-1)[..., :TOP_K]
        drafted = np.asarray(eagle.to_target_ids(head["d2t"], jnp.asarray(ranked)))
        hits = drafted == argmax[:, np.minimum(at, T - 1), None]
        result[f"depth {k + 1} top-1"] = round(float(hits[:, rows, 0].mean()), 4)
        if k == 0:
            result[f"depth 1 top-{TOP_K}"] = round(float(hits[:, rows].any(-1).mean()), 4)
            result["positions"] = int(tokens.shape[0] * rows.sum())
    scored = np.asarray(target.in_vocab)[:, max(start, 0):]  # the predictions of positions >= start
    result["in draft vocabulary"] = round(float(scored.mean()), 4)
    if draws:
        result["draws"] = draw_acceptance(head, ecfg, params, cfg, tokens, outs, start)
    return result


def vocabulary_coverage(logits: jax.Array, start: int, vocabularies: dict[int, np.ndarray]) -> dict:
    """For each size n, the share of the target's argmax (its `logits` [N, T, V] over a text) over
    positions >= `start` that a draft vocabulary of n tokens (`vocabularies`: size -> target ids) holds."""
    argmax = np.asarray(jnp.argmax(logits, axis=-1))[:, max(start, 0):]
    return {n: round(float(np.isin(argmax, ids).mean()), 4) for n, ids in vocabularies.items()}


def target_bound(logits: jax.Array, start: int, chains=(2, 4)) -> dict:
    """What a perfect head could get from the target (its `logits` [N, T, V] over a text) sampling at
    T 0.7, top-p 0.95 with top draws (eagle's default): the mean over positions >= `start` of the
    target's largest probability, which is a perfect top-1 candidate's chance of acceptance, and a
    perfect chain's tokens an iteration (1 + the sum of the running products of those probabilities
    along the text)."""
    top = np.asarray(jnp.max(process_logits(logits, SamplingConfig(temperature=0.7, top_p=0.95)), axis=-1))
    top = top[:, max(start, 0):-1]  # the predictions of the scored positions' tokens
    result = {"target top-1 probability": round(float(top.mean()), 4)}
    for g in chains:
        runs = np.stack([np.cumprod(top[:, t:t + g], axis=1).sum(axis=1) for t in range(top.shape[1] - g)], axis=1)
        result[f"perfect chain of {g}"] = round(float(1 + runs.mean()), 3)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", required=True, help="head directories, comma-separated")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--new", type=int, default=200, help="tokens of each generated answer")
    p.add_argument("--window", type=int, default=512,
                   help="tokens of each of the two held-out document windows, and of the continuation's prompt")
    p.add_argument("--texts", default=",".join(TEXTS), help="which texts, comma-separated")
    p.add_argument("--vocab-sizes", default="", type=lambda s: [int(n) for n in s.split(",") if n],
                   help="also each text's coverage by draft vocabularies of these sizes (vocabulary_coverage)")
    p.add_argument("--request-openers", action="store_true",
                   help="`fresh data` with its requests begun with openers (train_eagle --request-openers)")
    p.add_argument("--draws", action="store_true",
                   help="also each depth's acceptance with top and with sampled draws (draw_acceptance)")
    p.add_argument("--out", type=Path, default=common.RESULTS / "head_quality_cpu.json")
    args = p.parse_args(argv)
    names = args.texts.split(",")
    if not set(names) <= set(TEXTS):
        p.error(f"--texts: expected names of {TEXTS}, got {args.texts!r}")
    cfg, params, tokenizer = load_model(args.model, dtype="float32")
    rows = texts(params, cfg, tokenizer, args.new, args.window, names, args.request_openers)
    heads = [Path(h) for h in args.heads.split(",")]
    results = {str(h): {name: accuracy(h, params, cfg, t, start, args.draws) for name, (t, start) in rows.items()}
               for h in heads}
    keys = [k for k in results[str(heads[0])][next(iter(rows))] if k not in ("positions", "draws")]
    print(f"{', '.join(keys)} (the target's argmax among the head's drafts)\n")
    print("| text (positions) | " + " | ".join(h.name or str(h) for h in heads) + " |")
    print("|---|" + "---|" * len(heads))
    for name in rows:
        cells = [" / ".join(f"{results[str(h)][name][k]:.2f}" for k in keys) for h in heads]
        print(f"| {name} ({results[str(heads[0])][name]['positions']}) | " + " | ".join(cells) + " |")
    if args.draws:
        print("\nEach depth's acceptance, the target sampling at T 0.7, top-p 0.95: top draws / sampled draws\n")
        print("| text | head | " + " | ".join(f"depth {k + 1}" for k in range(DEPTHS)) + " |")
        print("|---|---|" + "---|" * DEPTHS)
        for name in rows:
            for h in heads:
                d = results[str(h)][name]["draws"]
                print(f"| {name} | {h.name} | " + " | ".join(
                    f"{d[f'depth {k + 1} top']:.3f} / {d[f'depth {k + 1} sampled']:.3f}" for k in range(DEPTHS)) + " |")
    # The draft vocabularies a head trained on the documents alone would get (training.eagle.draft_vocabulary)
    stream = data.token_stream(tokenizer, data.split_documents()[0]) if args.vocab_sizes else None
    vocabularies = {n: draft_vocabulary(stream, cfg.vocab_size, n) for n in args.vocab_sizes}

    def row_mean(measure, name):
        """`measure(logits [1, T, V], start)` of each row of a text (one forward a row: a text of many
        windows would hold all their logits at once), averaged over its rows of equal length."""
        tokens, start = rows[name]
        each = [measure(decoder.score(params, cfg, jnp.asarray(row[None])), start) for row in tokens]
        return {k: round(float(np.mean([e[k] for e in each])), 4) for k in each[0]}

    coverage = {name: row_mean(lambda x, start: vocabulary_coverage(x, start, vocabularies), name)
                for name in rows} if vocabularies else {}
    if vocabularies:
        print("\nThe target's argmax in the training documents' n most frequent tokens, n = " +
              ", ".join(map(str, vocabularies)) + ":")
        for name, shares in coverage.items():
            print(f"- {name}: " + ", ".join(f"{v:.3f}" for v in shares.values()))
    bounds = {name: row_mean(target_bound, name) for name in rows}
    print("\nA perfect head with top draws, the target sampling at T 0.7, top-p 0.95:")
    for name, bound in bounds.items():
        print(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in bound.items()))
    record = {**common.run_info(), "texts": {name: int(t.size) for name, (t, _) in rows.items()}, "accuracy": results,
              "vocabulary coverage": coverage, "perfect head": bounds}
    common.write_json(args.out, record)


if __name__ == "__main__":
    main()
