"""Training an EAGLE-3 head (`models.eagle`) for a target model by self-distillation.

    self_distill(cfg, params, tokenizer, tokens, seq, ...) -> token stream   the target's own text
    draft_vocabulary(stream, vocab_size, size) -> ids     the most frequent tokens, sorted
    init_head(key, ecfg, ids) -> params                   random head (float32), d2t from the ids
    share_lm_head(ecfg, head) -> (ecfg, head)             a head's layer, through the target's LM head
    make_step(cfg, ecfg, ttt, ...) -> (optimizer, step)   AdamW on the head; step(...) -> losses, accs
    train(...)                                            the loop: progress lines, checkpoints
    write_state / read_record / load_state                the resumable train state

Data: prompts are windows of `training.data`'s training documents (the held-out ones are never
used), with one of `corpus.TASKS` through the chat template when the model has one; with a chat
template, a share of the prompts (`chat_share`) are instead short requests the target wrote itself
(`asker`: it continues its template up to where a user's message starts, as Magpie does; with
`openers`, the message begun with a question or task opener), so the head also sees the target
answering ordinary chat. The target continues the prompts with jaxspec's batched decoding
(temperature 0.7, top-p 0.95) until it stops or the sequence reaches `seq` tokens.
Prompt and continuation, concatenated sequence after sequence, are the token stream; training
windows are random [B, seq] cuts of it. A window may span two sequences: the labels are the target's
own distributions over that window (teacher-forced), so what the head learns is still the target.
SmolLM2's continuations often end in loops (measured on CPU: over half of a sample's positions repeat
the 6 tokens before them, where a head's top-1 accuracy is 0.95 against 0.64 elsewhere): `cut_loops`
keeps each continuation only up to where it starts to repeat itself (`loop_cut`), so the same tokens
hold more distinct text.

Loss (`ttt_loss`): EAGLE-3's training-time test (`eagle.ttt_forward`): for step k the head's
draft-vocabulary distribution at row t against the target's next-token distribution at position
t + k + 1, restricted to the draft vocabulary and renormalised; cross-entropy over rows in range whose
target argmax is in the draft vocabulary (as SpecForge masks), steps weighted TTT_DECAY^k. A head that
shares the target's LM head (`EagleConfig.shared_lm_head`) drafts and learns over the whole vocabulary
through it, the LM head frozen (it is the target's). The top-1
accuracy of step k (the head's argmax is the target's, over every row in range) is the acceptance
proxy the progress line reports.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import zipfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import corpus, files
from jaxspec.decoding.engine import Engine
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, eagle
from jaxspec.models.config import ModelConfig
from jaxspec.models.eagle import EagleConfig
from jaxspec.training.data import split_documents, token_stream

Params = decoder.Params

TTT_DECAY = 0.8  # step k's loss weight is TTT_DECAY ** k (EAGLE-3, SpecForge)
SAMPLING = SamplingConfig(temperature=0.7, top_p=0.95)
QUERY_TOKENS = 96  # the longest such request
QUERY_SAMPLING = SamplingConfig(temperature=1.0)  # Magpie's: the target's own spread of requests
# Openers of the requests with `openers`: SmolLM2's own requests are mostly "Can you provide ..." and "I'm
# looking for ..." about work and shopping, while people ask it why and how things are, and for stories
# and lists; a request the target begins with one of these, then writes itself, covers those forms
# (bench/NOTES.md, "where the head's agreement is lost"). "" keeps one row in each cycle Magpie's own.
OPENERS = ("", "Why", "How does", "What is", "What are", "Explain", "Describe", "Write a", "Give me",
           "How can I", "What happens", "Tell me about")
INIT_SCALE = 0.02  # std of the random weights (HF Llama's initializer_range)


# ---------------------------------------------------------------------------------------------------
# Data: the target's own continuations of training prompts


def prompt_ids(tokenizer, window: np.ndarray, task: str) -> list[int]:
    """A prompt from a window of document tokens: the text with a task through the chat template when
    the model has one, else the bare document tokens (to be continued)."""
    if not tokenizer.has_chat_template:
        return window.tolist()
    text = tokenizer.decode(window)
    title = next((line for line in text.splitlines() if line.strip()), "documentation")[:60]
    content = text + "\n\n" + corpus.TASKS[task].format(title=title)
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


def query_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user's message starts (Magpie's pre-query template):
    a conversation's opening, system prompt included, with the user's turn begun."""
    marker = "\x00request\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False)
    return tokenizer.encode(text[:text.index(marker)])


def asker(cfg: ModelConfig, tokenizer, rows: int, backend: str, openers: bool = False
          ) -> Callable[[Params, jax.Array], list[str]]:
    """ask(params, key) -> requests: `rows` user messages the target writes itself, continuing
    `query_prefix` (with `openers`, row i's message begun with OPENERS[i % len(OPENERS)]) at temperature
    1 (one `Engine.generate` program); a message that does not end within QUERY_TOKENS, or is empty, is
    left out."""
    prefix = query_prefix(tokenizer)
    begun = [OPENERS[i % len(OPENERS)] if openers else "" for i in range(rows)]
    starts = [tokenizer.encode(opener) if opener else [] for opener in begun]
    width = len(prefix) + max(map(len, starts))
    engine = Engine(cfg, SpecConfig(backend=backend).validate(), QUERY_SAMPLING, width + QUERY_TOKENS)
    generate = jax.jit(engine.generate)
    stop_ids = jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)
    ids = jnp.asarray([prefix + start + [0] * (width - len(prefix) - len(start)) for start in starts], jnp.int32)
    lengths = jnp.asarray([len(prefix) + len(start) for start in starts], jnp.int32)

    def ask(params: Params, key: jax.Array) -> list[str]:
        out = generate(params, ids, lengths, key, max_new_tokens=QUERY_TOKENS, stop_ids=stop_ids)
        tokens, length = jax.device_get((out.tokens, out.length))
        requests = []
        for row, n in zip(tokens, length):
            message = row[len(prefix):n].tolist()
            if message and message[-1] in cfg.eos_token_ids:  # it ended: a whole request
                requests.append(tokenizer.decode(message[:-1], skip_special_tokens=True).strip())
        return [r for r in requests if r]

    return ask


def self_distill(cfg: ModelConfig, params: Params, tokenizer, tokens: int, seq: int, batch: int = 256,
                 seed: int = 0, backend: str = "reference", log: Callable[[str], None] | None = None,
                 chat_share: float = 0.5, cut_loops: bool = False, openers: bool = False) -> np.ndarray:
    """At least `tokens` tokens [N] int32 of (prompt + the target's continuation) sequences of at most
    `seq` tokens each. A round prompts `batch` rows with windows of seq / 8 .. seq / 2 tokens of the
    training documents at random offsets (one of `corpus.TASKS` each), `chat_share` of them instead
    with a request the target wrote itself (`asker`, begun with OPENERS with `openers`) when it has a
    chat template, and decodes them in one `Engine.generate` (one program: prompts padded to seq - 1;
    plain decoding on `backend`'s kernels) until each row emits a stop token or fills `seq`; with
    `cut_loops` each sequence is kept up to its `loop_cut`."""
    stream = token_stream(tokenizer, split_documents()[0])
    low, high = max(seq // 8, 1), max(seq // 2, 2)
    if len(stream) < high:
        raise JaxspecError(f"the training text has {len(stream)} tokens, fewer than a prompt window of {high}")
    generate = jax.jit(Engine(cfg, SpecConfig(backend=backend).validate(), SAMPLING, seq).generate)
    asked = int(batch * chat_share) if tokenizer.has_chat_template else 0
    ask = asker(cfg, tokenizer, asked, backend, openers) if asked else None
    stop_ids = jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)
    rng = np.random.default_rng(seed)
    tasks = list(corpus.TASKS)
    sequences, total, generated, start = [], 0, 0, time.perf_counter()
    while total < tokens:
        key = jax.random.key(seed * 1_000_003 + len(sequences))
        requests = ask(params, jax.random.fold_in(key, 1)) if ask else []
        ids = np.zeros((batch, seq - 1), np.int32)
        lengths = np.zeros(batch, np.int32)
        for b in range(batch):
            if b < len(requests):
                prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": requests[b]}]))
            else:
                size = int(rng.integers(low, high + 1))
                at = int(rng.integers(0, len(stream) - size + 1))
                prompt = prompt_ids(tokenizer, stream[at:at + size], tasks[int(rng.integers(len(tasks)))])
            prompt = prompt[-(seq - 1):]
            ids[b, :len(prompt)], lengths[b] = prompt, len(prompt)
        out = generate(params, jnp.asarray(ids), jnp.asarray(lengths), key,
                       max_new_tokens=jnp.asarray(seq - lengths), stop_ids=stop_ids)
        out_tokens, out_length = jax.device_get((out.tokens, out.length))
        kept = [out_tokens[b, :out_length[b]].astype(np.int32) for b in range(batch)]
        if cut_loops:
            kept = [x[:loop_cut(x, int(lengths[b]))] for b, x in enumerate(kept)]
        sequences += kept
        total += sum(len(x) for x in kept)
        generated += int(out_length.sum())
        if log:
            log(f"data: {total:,}/{tokens:,} tokens ({len(sequences)} sequences of {total // len(sequences)} on "
                f"average, {len(requests)} of the last {batch} prompted by the target's own requests"
                + (f", {total / generated:.0%} of the generated kept" if cut_loops else "")
                + f"), {total / (time.perf_counter() - start):,.0f} tok/s")
    return np.concatenate(sequences)


LOOP_GRAM = 6  # a token repeats the text when the LOOP_GRAM tokens ending with it occurred before
LOOP_WINDOW = 64  # a continuation is cut once LOOP_SHARE of its last LOOP_WINDOW tokens repeat the text
LOOP_SHARE = 0.5


def loop_cut(sequence: np.ndarray, prompt_len: int) -> int:
    """How much of `sequence` (a prompt of `prompt_len` tokens, then the target's continuation) to
    keep: all of it, or up to the first continuation token at which LOOP_SHARE of the continuation's
    last LOOP_WINDOW tokens repeat the text before them (prompt included: copying it is repeating too),
    so a loop's first repetitions stay, as inference meets them, and its many more go. The n-grams are
    compared by a 64-bit rolling hash."""
    n = len(sequence)
    if n - prompt_len < LOOP_WINDOW or n < LOOP_GRAM:
        return n
    ids = sequence.astype(np.uint64)
    grams = np.zeros(n - LOOP_GRAM + 1, np.uint64)
    for j in range(LOOP_GRAM):  # wraps modulo 2^64
        grams = grams * np.uint64(0x9E3779B97F4A7C15) + ids[j:n - LOOP_GRAM + 1 + j]
    _, first, inverse = np.unique(grams, return_index=True, return_inverse=True)
    repeats = np.zeros(n, bool)
    repeats[LOOP_GRAM - 1:] = first[inverse] < np.arange(len(grams))  # token t ends an n-gram seen before
    running = np.concatenate([[0], np.cumsum(repeats[prompt_len:])])
    in_window = running[LOOP_WINDOW:] - running[:-LOOP_WINDOW]  # over continuation tokens t - 63 .. t
    looping = np.flatnonzero(in_window >= LOOP_SHARE * LOOP_WINDOW)
    return n if looping.size == 0 else prompt_len + int(looping[0]) + LOOP_WINDOW


def windows(stream: np.ndarray, seq: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Training step `step`'s batch: [batch, seq] cuts of the stream at random offsets (a function of
    the seed and the step, so a resumed run sees the batches it would have)."""
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(stream) - seq + 1, batch)
    return np.stack([stream[s:s + seq] for s in starts])


# ---------------------------------------------------------------------------------------------------
# The head: vocabulary, config, init


def draft_vocabulary(stream: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent tokens of the stream (ties and unseen tokens by id), sorted: the draft
    vocabulary's target ids (d2t = ids - arange(size))."""
    counts = np.bincount(stream, minlength=vocab_size)[:vocab_size]
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def default_draft_vocab(vocab_size: int) -> int:
    """min(32768, V / 4): EAGLE-3's 32K for large vocabularies; SmolLM2's 49152 gives 12288, which
    keeps its bfloat16 head under 25 MB (5.1M layer weights + a 12288 x 576 LM head = 24.5 MB)."""
    return min(32768, vocab_size // 4)


def head_config(cfg: ModelConfig, draft_vocab: int, window: int = 0, shared_lm_head: bool = False) -> EagleConfig:
    """A head of the target's width, heads, MLP, RoPE and norm epsilon, reading EAGLE-3's default
    feature layers (one-line error for a target too shallow to have three distinct ones); `window`:
    its training sequences' length, the farthest it attends at inference (`EagleConfig.sliding_window`);
    `shared_lm_head`: it drafts through the target's LM head (draft_vocab must be the whole vocabulary)."""
    layers = eagle.default_feature_layers(cfg.num_layers)
    if len(set(layers)) != 3 or min(layers) < 0 or max(layers) >= cfg.num_layers:
        raise JaxspecError(f"an EAGLE-3 head reads layers (2, L / 2, L - 3) of its target: the model's "
                           f"{cfg.num_layers} layers are too few (at least 7)")
    if not 0 < draft_vocab <= cfg.vocab_size:
        raise JaxspecError(f"--draft-vocab must be in 1..{cfg.vocab_size} (the model's vocabulary), got {draft_vocab}")
    if shared_lm_head and draft_vocab != cfg.vocab_size:
        raise JaxspecError(f"a head that shares the model's LM head drafts over its whole vocabulary "
                           f"({cfg.vocab_size}), not {draft_vocab}")
    return EagleConfig(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, draft_vocab_size=draft_vocab, vocab_size=cfg.vocab_size,
        target_hidden_size=cfg.hidden_size, feature_layers=layers, rms_norm_eps=cfg.rms_norm_eps, rope=cfg.rope,
        max_position_embeddings=cfg.max_position_embeddings, sliding_window=window, shared_lm_head=shared_lm_head)


def init_head(key: jax.Array, ecfg: EagleConfig, draft_ids: np.ndarray) -> Params:
    """A float32 head to train: matrices normal * INIT_SCALE, norms 1, d2t of the draft vocabulary."""
    params = {}
    shapes = eagle.param_shapes(ecfg)
    for (name, shape), k in zip(shapes.items(), jax.random.split(key, len(shapes))):
        if name.endswith("norm"):
            params[name] = jnp.ones(shape, jnp.float32)
        elif name != "d2t":
            params[name] = INIT_SCALE * jax.random.normal(k, shape, jnp.float32)
    params["d2t"] = jnp.asarray(draft_ids - np.arange(len(draft_ids)), jnp.int32)
    return params


def extend_vocabulary(ecfg: EagleConfig, head: Params, target_params: Params, stream: np.ndarray,
                      size: int) -> tuple[EagleConfig, Params]:
    """A head's draft vocabulary grown to `size` tokens: its own and the stream's most frequent tokens
    outside them (unseen ones by id), sorted. A new token's LM-head column starts as the least-squares
    map from the target's output rows (its LM head's, or the tied embedding's) that takes the head's own
    tokens' rows nearest to their columns: training goes on from there, and the tokens the head had
    keep their columns."""
    V = ecfg.vocab_size
    ids = np.asarray(eagle.to_target_ids(head["d2t"], jnp.arange(ecfg.draft_vocab_size)))
    counts = np.bincount(stream, minlength=V)[:V].astype(np.int64)
    counts[ids] = -1
    extra = np.argsort(-counts, kind="stable")[:size - len(ids)]
    rows = np.asarray(target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T,
                      np.float64).T  # [V, Ht], a bfloat16 target's too
    lm_head = np.asarray(head["lm_head"], np.float32)
    to_column, *_ = np.linalg.lstsq(rows[ids], lm_head.T.astype(np.float64), rcond=None)
    tokens = np.concatenate([ids, extra])
    order = np.argsort(tokens)
    columns = np.concatenate([lm_head, (rows[extra] @ to_column).T.astype(np.float32)], axis=1)[:, order]
    grown = {**head, "lm_head": jnp.asarray(columns), "d2t": jnp.asarray(tokens[order] - np.arange(size), jnp.int32)}
    return dataclasses.replace(ecfg, draft_vocab_size=size), grown


def share_lm_head(ecfg: EagleConfig, head: Params) -> tuple[EagleConfig, Params]:
    """A head's layer weights drafting through the target's LM head instead of its own: its LM head
    dropped, the draft vocabulary the whole vocabulary (d2t zeros). Training goes on from the layer."""
    ecfg = dataclasses.replace(ecfg, shared_lm_head=True, draft_vocab_size=ecfg.vocab_size)
    kept = {name: w for name, w in head.items() if name not in ("lm_head", "d2t")}
    return ecfg, {**kept, "d2t": jnp.zeros(ecfg.vocab_size, jnp.int32)}


# ---------------------------------------------------------------------------------------------------
# The loss


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Teacher:
    """The target over a token batch [B, T] (no gradients)."""

    features: jax.Array  # [B, T, 3 Ht] the head's input features
    logp: jax.Array  # [B, T, Vd] float32 log-probabilities restricted to the draft vocabulary, renormalised
    argmax: jax.Array  # [B, T] the target's top-1 token (target ids)
    in_vocab: jax.Array  # [B, T] bool: the argmax is in the draft vocabulary


def teacher(target_params: Params, cfg: ModelConfig, ecfg: EagleConfig, d2t: jax.Array, tokens: jax.Array) -> Teacher:
    """A teacher-forced forward of the target from position 0: its features and next-token distributions."""
    logits, features = decoder.score(target_params, cfg, tokens, capture=ecfg.feature_layers)  # [B, T, V] float32
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if ecfg.draft_vocab_size == cfg.vocab_size:  # the whole vocabulary, d2t zeros
        return Teacher(features, jax.nn.log_softmax(logits, axis=-1), argmax, jnp.ones(argmax.shape, bool))
    ids = eagle.to_target_ids(d2t, jnp.arange(ecfg.draft_vocab_size))
    in_vocab = jnp.zeros(cfg.vocab_size, bool).at[ids].set(True)
    return Teacher(features, jax.nn.log_softmax(logits[..., ids], axis=-1), argmax, in_vocab[argmax])


def ttt_loss(trainable: Params, d2t: jax.Array, ecfg: EagleConfig, target_params: Params, cfg: ModelConfig,
             tokens: jax.Array, target: Teacher, steps: int, remat: bool = True):
    """(weighted loss, (per-step losses [steps], per-step top-1 accuracies [steps])) of the head over a
    token batch (see the module docstring). The head runs in the target's dtype from its float32
    weights; step k's row t is scored against the target at position t + k + 1."""
    head = jax.tree.map(lambda w: w.astype(cfg.dtype), trainable)
    outs = eagle.ttt_forward(head, ecfg, target_params, cfg, tokens, target.features, steps, remat)
    B, T = tokens.shape

    def step_loss(out, k):
        n = T - 1 - k  # rows t in range: t + k + 1 <= T - 1 (the rest read past the batch: garbage)
        at = lambda x: x[:, k + 1:]  # the target at t + k + 1
        logq = jax.nn.log_softmax(eagle.draft_logits(head, ecfg, target_params, cfg, out[:, :n]), axis=-1)
        mask = at(target.in_vocab)
        ce = -jnp.sum(jnp.exp(at(target.logp)) * logq, axis=-1)
        loss = jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
        hit = eagle.to_target_ids(d2t, jnp.argmax(logq, axis=-1)) == at(target.argmax)
        acc = jnp.sum(hit) / (B * n)
        return loss, acc

    if remat:
        step_loss = jax.checkpoint(step_loss, static_argnums=1)
    losses, accs = zip(*(step_loss(outs[k], k) for k in range(steps)))
    losses, accs = jnp.stack(losses), jnp.stack(accs)
    return jnp.sum(losses * TTT_DECAY ** jnp.arange(steps)), (losses, accs)


# ---------------------------------------------------------------------------------------------------
# The optimizer and the training step


def optimizer(lr: float, steps: int, warmup: int, clip: float = 0.5):
    """AdamW (no weight decay on norms) at peak `lr`: linear warmup over `warmup` steps, then cosine
    decay to lr / 20 at `steps`; gradients clipped to global norm `clip`."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 20)
    decay = lambda params: jax.tree.map(lambda w: w.ndim > 1, params)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.01, mask=decay))


@functools.lru_cache(maxsize=None)
def make_step(cfg: ModelConfig, ecfg: EagleConfig, ttt: int, lr: float, steps: int, warmup: int):
    """(optimizer, step): step(trainable, opt_state, d2t, target_params, tokens [B, T]) -> (trainable,
    opt_state, per-step losses, per-step accuracies), jitted (trainable and opt_state donated)."""
    import optax

    opt = optimizer(lr, steps, warmup)
    grad_fn = jax.value_and_grad(ttt_loss, has_aux=True)

    def step(trainable, opt_state, d2t, target_params, tokens):
        target = jax.lax.stop_gradient(teacher(target_params, cfg, ecfg, d2t, tokens))
        (_, (losses, accs)), grads = grad_fn(trainable, d2t, ecfg, target_params, cfg, tokens, target, ttt)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, losses, accs

    return opt, jax.jit(step, donate_argnums=(0, 1))


def trainable_part(head: Params) -> Params:
    """The head's weights without d2t (fixed by the data)."""
    return {name: w for name, w in head.items() if name != "d2t"}


# ---------------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass(frozen=True)
class Settings:
    """A training run's settings (`python -m jaxspec.train_eagle`'s flags; the defaults size a
    SmolLM2-135M run on one H200: see checkpoints/README.md)."""

    tokens: int = 6_000_000  # newly self-distilled tokens (prompts and continuations)
    steps: int = 1500
    batch: int = 16
    seq: int = 2048
    ttt: int = 7  # unrolled draft steps of the training-time test
    draft_vocab: int | None = None  # None: default_draft_vocab (the whole vocabulary with shared_lm_head)
    shared_lm_head: bool = False  # draft through the target's LM head (`EagleConfig.shared_lm_head`)
    lr: float = 5e-4
    warmup: int = 100
    seed: int = 0
    chat_share: float = 0.5  # of the prompts, with a chat template: requests the target wrote itself
    cut_loops: bool = False  # keep each continuation up to where it starts to repeat itself (`loop_cut`)
    openers: bool = False  # the target's requests begun with OPENERS (`asker`)


LOG_SECONDS = 5.0  # a progress line at most this often (and at the first and last step)


def train(cfg: ModelConfig, target_params: Params, ecfg: EagleConfig, stream: np.ndarray, trainable: Params,
          opt_state, d2t: jax.Array, settings: Settings, first_step: int = 0, history: list | None = None,
          checkpoint: Callable[[int, Params, object], None] | None = None, checkpoint_every: int = 500,
          log: Callable[[str], None] | None = None) -> tuple[Params, object]:
    """Steps first_step .. settings.steps - 1 of AdamW on the head (`make_step`) over `windows` of
    the stream; returns (trainable, opt_state). Every LOG_SECONDS `log` gets a line (step, loss,
    per-step accuracy, tokens/s) and `history` a record of the means since the last one;
    `checkpoint(step, trainable, opt_state)` runs every `checkpoint_every` steps. A non-finite loss
    is a one-line error."""
    s = settings
    _, step_fn = make_step(cfg, ecfg, s.ttt, s.lr, s.steps, s.warmup)
    pending, last, begin = [], time.perf_counter(), time.perf_counter()
    for step in range(first_step, s.steps):
        tokens = jnp.asarray(windows(stream, s.seq, s.batch, s.seed, step))
        trainable, opt_state, losses, accs = step_fn(trainable, opt_state, d2t, target_params, tokens)
        pending.append((losses, accs))
        done = step + 1
        now = time.perf_counter()
        if step == first_step or done == s.steps or now - last >= LOG_SECONDS:
            losses, accs = (np.mean(x, axis=0) for x in zip(*jax.device_get(pending)))
            weighted = float(np.sum(losses * TTT_DECAY ** np.arange(s.ttt)))
            if not np.isfinite(weighted):
                raise JaxspecError(f"the head's training diverged at step {done} (loss {weighted}); lower --lr")
            now = time.perf_counter()
            rate = len(pending) * s.batch * s.seq / (now - last)
            record = {"step": done, "loss": weighted, "losses": losses.round(4).tolist(),
                      "acc": accs.round(4).tolist(), "tokens_per_s": round(rate), "seconds": round(now - begin, 1)}
            if history is not None:
                history.append(record)
            if log:
                eta = "compile included" if step == first_step else f"{(s.steps - done) * s.batch * s.seq / rate:.0f} s to go"
                log(f"step {done}/{s.steps}  loss {weighted:.3f}  acc {' '.join(f'{a:.2f}' for a in accs)}  "
                    f"{rate / 1e3:,.1f}K tok/s  {now - begin:.0f} s ({eta})")
            pending, last = [], now
        if checkpoint and (done % checkpoint_every == 0 or done == s.steps):
            checkpoint(done, trainable, opt_state)
    return trainable, opt_state


# ---------------------------------------------------------------------------------------------------
# The resumable train state


STATE_DIR = "train_state"
DATA_FILE = "data.npy"


def write_state(directory: Path, trainable: Params, opt_state, d2t, record: dict) -> None:
    """Writes the train state into the new directory `directory`: every leaf of (trainable,
    opt_state, d2t) in leaves.npz and `record` (the step, the settings, the log so far) in state.json."""
    directory.mkdir(exist_ok=True)
    leaves = jax.tree.leaves((trainable, opt_state, d2t))
    np.savez(directory / "leaves.npz", **{f"{i:04d}": np.asarray(x) for i, x in enumerate(leaves)})
    (directory / "state.json").write_text(json.dumps(record, indent=1) + "\n")


def read_record(out: Path) -> dict:
    """The record of out/train_state (the step, the settings, the log so far)."""
    return files.read_json_object(out / STATE_DIR / "state.json", "train state")


def load_state(out: Path, like):
    """(trainable, opt_state, d2t) of out/train_state, shaped like `like`."""
    path = out / STATE_DIR
    try:
        with np.load(path / "leaves.npz") as f:
            leaves = [f[name] for name in sorted(f.files)]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise JaxspecError(f"cannot read the train state {path}: {e}") from None
    if [x.shape for x in leaves] != [np.shape(x) for x in jax.tree.leaves(like)]:
        raise JaxspecError(f"the train state {path} does not fit this run's head and optimizer")
    return jax.tree.unflatten(jax.tree.structure(like), [jnp.asarray(x) for x in leaves])


def write_data(path: Path, stream: np.ndarray) -> None:
    """The token stream as a .npy file at `path` (any name: np.save would add a suffix)."""
    with open(path, "wb") as f:
        np.save(f, stream)


def load_data(out: Path, vocab_size: int | None = None) -> np.ndarray:
    """The token stream of out/data.npy; with `vocab_size`, checked to be token ids of a vocabulary that
    size (a run of another model's is a one-line error, not a wrong head)."""
    path = out / DATA_FILE
    try:
        stream = np.load(path)
    except (OSError, ValueError) as e:
        raise JaxspecError(f"cannot read the training data {path}: {e}") from None
    if stream.ndim != 1 or stream.dtype.kind not in "iu":
        raise JaxspecError(f"the training data {path} are not a token stream (a 1-D integer array)")
    if vocab_size is not None and len(stream) and not 0 <= stream.min() <= stream.max() < vocab_size:
        raise JaxspecError(f"the training data {path} hold token ids outside the model's vocabulary of {vocab_size} "
                           "(another model's data?)")
    return stream.astype(np.int32)
