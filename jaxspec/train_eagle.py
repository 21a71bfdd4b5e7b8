"""`python -m jaxspec.train_eagle`: train an EAGLE-3 draft head for a model (`--method eagle --draft-model DIR`).

    python -m jaxspec.train_eagle --model M --out DIR [--tokens N] [--steps S] [--batch B] [--seq T]
        [--ttt K] [--draft-vocab V | --shared-lm-head] [--lr X] [--dtype bfloat16|float32] [--seed N]
        [--chat-share X] [--cut-loops] [--request-openers] [--data RUN,...] [--init HEAD] [--resume]

Self-distillation (`jaxspec.training.eagle`): the model continues prompts of the training documents,
then the head learns EAGLE-3's training-time test against the model's own next-token distributions.
DIR gets the head in the public layout (config.json + model.safetensors, at --dtype), train_log.json
(the progress records, settings, data size, seconds), data.npy (the generated tokens) and train_state/
(head, optimizer, step: saved once the data are generated and every CHECKPOINT_EVERY steps, so
`--resume` continues an interrupted run with the same flags without generating the data again).
DIR must be new or empty, unless resuming; the finished directory replaces it at once. `--init HEAD`
starts from a head for the same model (its weights, draft vocabulary and config) instead of random
weights: a head trained further on newly generated data (another `--seed`), so training can go on in
pieces, e.g. one GPU session at a time. `--shared-lm-head` drafts through the model's own LM head over
its whole vocabulary (no token out of the head's reach, and no LM head in the checkpoint); with `--init`
of a head with its own LM head, its layer goes on through the model's.

The data are the slow part (a decode per token), so they can be pooled: `--steps 0` only generates
them (DIR gets data.npy and train_log.json, no head), and `--data RUN,...` trains on earlier runs'
data.npy after this run's new `--tokens` (`--tokens 0`: none new). So a head can see more distinct
text than one process has time to generate, e.g. two generating runs with other seeds, then one
training run on both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from jaxspec.errors import ArgumentParser, JaxspecError, cli_main, out_of_memory_as
from jaxspec.xla_flags import set_gpu_flags

CHECKPOINT_EVERY = 100  # steps between saved train states
GENERATION_BATCH = 256  # rows a data round decodes at once


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse(argv) -> tuple:
    """(args, Settings), the flags checked before anything is loaded or written."""
    from jaxspec.training.eagle import DATA_FILE, Settings

    d = Settings()
    p = ArgumentParser(prog="python -m jaxspec.train_eagle", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="smollm2 | a .gguf file | HF directory | orbax checkpoint")
    p.add_argument("--out", type=Path, required=True, help="the head's directory (new, empty, or resumed)")
    p.add_argument("--tokens", type=int, default=d.tokens,
                   help="tokens to self-distil (new data; 0: only --data's)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (0: generate the data only)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per training sequence (and longest generation)")
    p.add_argument("--ttt", type=int, default=d.ttt, help="unrolled draft steps of the training-time test")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary (default min(32768, V / 4)); with --init, the head's grown to this many "
                        "tokens (the data's most frequent outside it added)")
    p.add_argument("--shared-lm-head", action="store_true",
                   help="draft through the model's own LM head, over its whole vocabulary (no LM head of the head's)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warmup, then cosine decay)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="the model's and the saved head's dtype (the head trains in float32; default bfloat16 on a "
                        "GPU, float32 on a CPU, whose products take no bfloat16)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chat-share", type=float, default=d.chat_share,
                   help="share of the prompts that are requests the model wrote itself (with a chat template; the "
                        "rest are documentation tasks)")
    p.add_argument("--cut-loops", action="store_true",
                   help="keep each continuation only up to where it starts to repeat itself (more distinct text "
                        "for the same --tokens; the generation takes longer)")
    p.add_argument("--request-openers", action="store_true",
                   help="begin the model's own requests with question and task openers (why, how does, explain, "
                        "write a, ...): closer to what people ask than its unprompted requests")
    p.add_argument("--data", type=lambda s: [Path(x) for x in s.split(",")], default=[],
                   help="earlier runs' directories, comma-separated: their data.npy is trained on too (same model)")
    p.add_argument("--init", type=Path, default=None,
                   help="start from this head (weights, draft vocabulary, config) instead of random weights")
    p.add_argument("--resume", action="store_true", help="continue DIR's saved run")
    args = p.parse_args(argv)
    settings = Settings(tokens=args.tokens, steps=args.steps, batch=args.batch, seq=args.seq, ttt=args.ttt,
                        draft_vocab=args.draft_vocab, lr=args.lr, warmup=min(d.warmup, args.steps // 10),
                        seed=args.seed, chat_share=args.chat_share, cut_loops=args.cut_loops,
                        openers=args.request_openers,
                        shared_lm_head=args.shared_lm_head)
    if args.seq < 8 or args.batch < 1 or args.steps < 0 or args.ttt < 1 or not 0 < args.lr < math.inf:
        raise JaxspecError("need --seq >= 8, --batch >= 1, --steps >= 0, --ttt >= 1 and a finite --lr > 0")
    if args.ttt >= args.seq - 1:
        raise JaxspecError(f"--ttt {args.ttt} must be below --seq - 1 ({args.seq - 1})")
    if args.tokens == 0 and not args.data:
        raise JaxspecError("--tokens 0 trains on --data alone: name earlier runs with --data")
    if args.tokens < 0 or 0 < args.tokens < 4 * args.seq:
        raise JaxspecError(f"--tokens {args.tokens} is fewer than 4 sequences of --seq {args.seq}")
    if args.steps == 0 and (args.data or args.init or args.resume or args.tokens == 0):
        raise JaxspecError("--steps 0 only generates new data: no --data, --init or --resume, and --tokens > 0")
    for run in args.data:
        if not (run / DATA_FILE).is_file():
            raise JaxspecError(f"--data {run} has no {DATA_FILE} (a train_eagle run's directory)")
    if not 0 <= args.chat_share <= 1:
        raise JaxspecError(f"--chat-share must be in [0, 1], got {args.chat_share}")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise JaxspecError(f"--draft-vocab must be positive, got {args.draft_vocab}")
    if args.init is not None and not (args.init / "config.json").is_file():
        raise JaxspecError(f"--init {args.init} is not an EAGLE-3 head (no config.json)")
    if args.shared_lm_head and args.draft_vocab is not None:
        raise JaxspecError("--draft-vocab with --shared-lm-head: the head drafts over the model's whole vocabulary")
    out = args.out
    if out.exists() and not out.is_dir():
        raise JaxspecError(f"--out {out} is a file")
    if args.resume and not (out / "train_state").is_dir():
        raise JaxspecError(f"--resume: {out} has no train_state to continue")
    if not args.resume and out.is_dir() and any(out.iterdir()):
        raise JaxspecError(f"--out {out} is not empty (choose a new directory, or --resume a run saved there)")
    return args, settings


@cli_main
def main(argv=None) -> None:
    args, settings = parse(argv)
    import jax
    import numpy as np

    from jaxspec import files
    from jaxspec.loaders import load_model
    from jaxspec.loaders.eagle import head_fingerprint, load_eagle, write_eagle
    from jaxspec.models.eagle import to_target_ids
    from jaxspec.training import eagle as training

    begin = time.perf_counter()
    out = args.out
    args.dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    cfg, target, tokenizer = load_model(args.model, dtype=args.dtype)
    if args.seq + args.ttt > cfg.max_position_embeddings:
        raise JaxspecError(f"--seq {args.seq} + --ttt {args.ttt} is past the model's context {cfg.max_position_embeddings}")
    start = None  # --init's head
    if args.init is not None:
        ecfg, start = load_eagle(args.init, cfg, "float32")  # one-line error for a head that does not fit
        if "embed" in start:
            raise JaxspecError(f"--init {args.init} has its own embedding, which train_eagle does not train")
        if settings.shared_lm_head and not ecfg.shared_lm_head:  # its layer, through the model's LM head
            ecfg, start = training.share_lm_head(ecfg, start)
        if ecfg.shared_lm_head and settings.draft_vocab is not None:
            raise JaxspecError(f"--draft-vocab with --init {args.init}: it drafts over the model's whole vocabulary")
        if not ecfg.draft_vocab_size <= (settings.draft_vocab or ecfg.draft_vocab_size) <= cfg.vocab_size:
            raise JaxspecError(f"--draft-vocab {settings.draft_vocab} with --init {args.init}: a head's draft "
                               f"vocabulary only grows, from its {ecfg.draft_vocab_size} tokens up to the model's "
                               f"{cfg.vocab_size}")
        settings = dataclasses.replace(settings, draft_vocab=settings.draft_vocab or ecfg.draft_vocab_size,
                                       shared_lm_head=ecfg.shared_lm_head)
    else:
        whole = cfg.vocab_size if settings.shared_lm_head else None
        settings = dataclasses.replace(settings, draft_vocab=settings.draft_vocab or whole
                                       or training.default_draft_vocab(cfg.vocab_size))
        ecfg = training.head_config(cfg, settings.draft_vocab, settings.seq, settings.shared_lm_head)
    record = {"model": args.model, "dtype": args.dtype, "settings": dataclasses.asdict(settings),
              "init": head_fingerprint(args.init) if args.init is not None else None,
              "data": [str(run) for run in args.data] or None}
    if args.resume:
        saved = training.read_record(out)
        if isinstance(saved.get("settings"), dict):  # a run saved before a setting existed had its default
            saved["settings"] = {**dataclasses.asdict(training.Settings()), **saved["settings"]}
        for key in ("model", "dtype", "settings", "init", "data"):
            if saved.get(key) != record[key]:
                raise JaxspecError(f"--resume: {out} was trained with {key} {saved.get(key)}, not {record[key]}")
        stream = training.load_data(out)
    else:
        earlier = [training.load_data(run, cfg.vocab_size) for run in args.data]
        new = []
        if settings.tokens:
            rows = min(GENERATION_BATCH, -(-settings.tokens // settings.seq))
            backend = "pallas" if jax.default_backend() == "gpu" else "reference"  # generate's default
            new = [training.self_distill(cfg, target, tokenizer, settings.tokens, settings.seq, rows, settings.seed,
                                         backend, log, settings.chat_share, settings.cut_loops, settings.openers)]
        stream = np.concatenate(new + earlier)
        if len(stream) < 4 * settings.seq:
            raise JaxspecError(f"the data hold {len(stream)} tokens, fewer than 4 sequences of --seq {settings.seq}")
        if earlier:
            log(f"data: {len(stream):,} tokens: {sum(map(len, new)):,} new, "
                + ", ".join(f"{len(x):,} of {run}" for x, run in zip(earlier, args.data)))
        files.write_file(out / training.DATA_FILE, lambda tmp: training.write_data(tmp, stream))
        if settings.steps == 0:
            record.update(step=0, log=[], data_tokens=len(stream), seconds=round(time.perf_counter() - begin, 1))
            files.write_file(out / "train_log.json", lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))
            log(f"saved {out}: {len(stream):,} tokens of data (--steps 0: no head); train on them with --data {out}")
            return
    if start is None:
        ids = training.draft_vocabulary(stream, cfg.vocab_size, settings.draft_vocab)
        head = training.init_head(jax.random.key(settings.seed), ecfg, ids)
    else:
        head = jax.tree.map(jax.numpy.asarray, start)
        if settings.draft_vocab > ecfg.draft_vocab_size:
            ecfg, head = training.extend_vocabulary(ecfg, head, target, stream, settings.draft_vocab)
        ids = to_target_ids(np.asarray(head["d2t"]), np.arange(ecfg.draft_vocab_size))
    log(f"draft vocabulary: {len(ids)} of {cfg.vocab_size} tokens, {np.isin(stream, ids).mean():.1%} of the data")
    trainable, d2t = training.trainable_part(head), head["d2t"]
    opt, _ = training.make_step(cfg, ecfg, settings.ttt, settings.lr, settings.steps, settings.warmup)
    state = (trainable, opt.init(trainable), d2t)
    history, first, seconds = [], 0, 0.0
    if args.resume:
        state = training.load_state(out, state)
        history, first, seconds = saved["log"], saved["step"], saved["seconds"]
    trainable, opt_state, d2t = state

    def full_record(step: int) -> dict:
        return {**record, "step": step, "log": history, "data_tokens": len(stream),
                "seconds": round(seconds + time.perf_counter() - begin, 1)}

    def checkpoint(step, trainable, opt_state):
        files.write_dir(out / training.STATE_DIR, lambda tmp: training.write_state(
            tmp, trainable, opt_state, d2t, full_record(step)))

    if not args.resume:  # the data are the slow part: a run stopped at any step resumes without them
        checkpoint(0, trainable, opt_state)
    with out_of_memory_as(lambda: f"a training step of --batch {settings.batch} x --seq {settings.seq} tokens "
                          "does not fit this device; lower --batch or --seq"):
        trainable, opt_state = training.train(cfg, target, ecfg, stream, trainable, opt_state, d2t, settings, first,
                                              history, checkpoint, CHECKPOINT_EVERY, log)
    head = {**jax.tree.map(lambda w: np.asarray(w.astype(args.dtype)), trainable), "d2t": np.asarray(d2t)}
    final = full_record(settings.steps)

    def write(tmp: Path) -> None:
        write_eagle(tmp, ecfg, head)
        training.write_state(tmp / training.STATE_DIR, trainable, opt_state, d2t, final)
        training.write_data(tmp / training.DATA_FILE, stream)
        (tmp / "train_log.json").write_text(json.dumps(final, indent=1) + "\n")

    files.write_dir(out, write)
    last = history[-1] if history else {}
    log(f"saved {out}: {settings.steps} steps, loss {last.get('loss', float('nan')):.3f}, "
        f"accuracy by step {last.get('acc')}, {final['seconds']:.0f} s")


if __name__ == "__main__":
    set_gpu_flags()
    main()
