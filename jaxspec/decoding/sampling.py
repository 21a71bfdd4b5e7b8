"""Logits processing and token sampling, shared by the drafter and the verifier.

Speculative decoding is exact only if the draft distribution q and the target distribution p come
from the same processing, which is why both sides go through this module.

Processing order (that of Hugging Face's logits warpers), each filter acting on the result of the
previous one:
  1. temperature: logits / T;
  2. top-k: keep the k largest logits;
  3. top-p: nucleus over the tempered, top-k-filtered distribution: walking tokens from the most
     likely, keep a token while the mass before it is < top_p (so the most likely token is kept);
  4. min-p: keep tokens with p >= min_p * max p.
Every filter keeps the tokens whose tempered logit is at least a per-row threshold, so the whole
processing is one threshold plus a log-normaliser (`cutoff`). Tokens tied with the last kept token
are therefore kept too (as HF's top-k does; HF's top-p would break such ties by sort order), which
makes the result independent of how a sort orders equal logits: bf16 logits tie often.

The rules come in two forms. A `SamplingConfig` (static, hashable) holds one batch's values: the
compiled program applies only the filters it turns on (the CLI, tests, benchmarks). `RowSampling`
holds each row's own values as traced [B] arrays (a server's rows each follow their request; a row
with temperature 0 is greedy, its distribution the one-hot of the argmax); its static `max_top_k`
says how many top-k candidates are compiled. One code path serves both: a config's values are
scalars, a row's broadcast over its positions.

Top-p without top-k searches its threshold without sorting the vocabulary
(pallas_kernels/top_p.py): a kernel on the "pallas" backend, the same search in jnp on "reference".
The two round their sums differently, so a run uses one backend for every cutoff (plain steps,
drafts and targets): `backend` is the engine's kernel backend throughout.

Randomness is per row: a draw takes one key per row ([B] keys; a single key is split into B), so a
row's tokens depend on its own key only, whatever else shares the batch (a request's `seed`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxspec.errors import JaxspecError

ARGMAX_PICKS = 5  # a node's children picked by repeated argmax, up to this many (`top_indices`): a 5,3+1 root


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["temperature", "top_k", "top_p", "min_p"])
@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen, the same for every row; frozen and hashable (a leafless pytree), so it
    is static wherever it is passed."""

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    def __post_init__(self):
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raises JaxspecError naming the first invalid field (also run on construction)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise JaxspecError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise JaxspecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise JaxspecError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise JaxspecError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_k", "top_p", "min_p"],
                   meta_fields=["max_top_k", "nucleus"])
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Each row's own sampling values ([B] arrays, traced), for batches whose rows follow different
    requests. `max_top_k` (static) is the most top-k candidates any row may ask for (0: no top-k);
    `nucleus` (static) False: no row asks for top-p, so none is searched (`without_top_p`)."""

    temperature: jax.Array  # [B] float32, 0 = greedy row
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    min_p: jax.Array  # [B] float32, 0 = off
    max_top_k: int = 0
    nucleus: bool = True

    greedy = False  # rows may sample: the program carries distributions

    @classmethod
    def of(cls, configs: list[SamplingConfig], max_top_k: int) -> RowSampling:
        """The rows of `configs`, one each; a top_k above `max_top_k` is a JaxspecError."""
        for c in configs:
            if c.top_k > max_top_k:
                raise JaxspecError(f"top_k {c.top_k} is above this server's maximum of {max_top_k}")
        column = lambda name, dtype: jnp.asarray([getattr(c, name) for c in configs], dtype)
        return cls(column("temperature", jnp.float32), column("top_k", jnp.int32), column("top_p", jnp.float32),
                   column("min_p", jnp.float32), max_top_k)


Rules = SamplingConfig | RowSampling


def without_top_p(rules: Rules) -> Rules:
    """The rules with top-p off on every row (row rules then compile no nucleus search)."""
    if isinstance(rules, SamplingConfig):
        return dataclasses.replace(rules, top_p=1.0)
    return dataclasses.replace(rules, top_p=jnp.ones_like(rules.top_p), nucleus=False)


def _rows(value: jax.Array, ndim: int) -> jax.Array:
    """A row's [B] values reshaped to [B, 1, ...], broadcastable against `ndim` dims."""
    return value.reshape(value.shape + (1,) * (ndim - 1))


def _value(rules: Rules, name: str, ndim: int):
    """A rule's value, broadcastable against an array of `ndim` dims whose first axis is the row:
    a config's scalar, or a row's [B] array as [B, 1, ...]."""
    value = getattr(rules, name)
    return value if isinstance(rules, SamplingConfig) else _rows(value, ndim)


def _inverse_temperature(rules: Rules, ndim: int):
    """1 / T as float32 (a greedy row's is 1: its distribution is replaced by the argmax's one-hot)."""
    if isinstance(rules, SamplingConfig):
        return jnp.float32(1.0 / rules.temperature)
    t = rules.temperature
    return _rows(jnp.where(t > 0, 1.0 / jnp.where(t > 0, t, 1.0), 1.0).astype(jnp.float32), ndim)


def tempered(logits: jax.Array, rules: Rules) -> jax.Array:
    """Float32 logits times 1/T (sampling rules only). A product rounds the same wherever XLA puts
    it, so a threshold taken from some tempered values selects exactly those tokens everywhere."""
    return logits.astype(jnp.float32) * _inverse_temperature(rules, logits.ndim)


def cutoff(logits: jax.Array, rules: Rules, backend: str = "reference") -> tuple[jax.Array, jax.Array]:
    """(threshold, log_norm), each [..., 1], for sampling rules: token v is kept iff
    tempered(logits)[v] >= threshold, and then log p(v) = tempered(logits)[v] - log_norm.

    With top_k, top-p looks only at the top-k candidates of `lax.top_k` (a cumulative sum over the
    sorted values); without it, the kernel backend's sort-free nucleus search runs over the whole
    row. Both act on the raw logits, whose order the positive temperature preserves. A config
    compiles only the filters it turns on; row rules compile every filter (min-p 0 keeps all, a row
    without top_k takes the nucleus search's threshold), top-p (over the candidates or the row) unless
    `nucleus` is off.
    """
    per_row = isinstance(rules, RowSampling)
    V = logits.shape[-1]
    x = tempered(logits, rules)
    top = jnp.max(x, axis=-1, keepdims=True)
    top_k, top_p, min_p = (_value(rules, name, logits.ndim) for name in ("top_k", "top_p", "min_p"))

    def log_mass(threshold):
        kept = jnp.where(x >= threshold, jnp.exp(x - top), 0.0)
        return top + jnp.log(jnp.sum(kept, axis=-1, keepdims=True))

    threshold = jnp.full_like(top, -jnp.inf)
    # static: how many top-k candidates are compiled (a config's top_k >= V filters nothing)
    candidates_k = min(rules.max_top_k, V) if per_row else (rules.top_k if rules.top_k < V else 0)
    by_candidates = jnp.logical_and(top_k > 0, candidates_k > 0)
    if candidates_k > 0:
        candidates = tempered(jax.lax.top_k(logits, candidates_k)[0], rules)  # descending
        k = jnp.clip(top_k, 1, candidates_k)
        kth = jnp.take_along_axis(candidates, jnp.broadcast_to(k - 1, top.shape), axis=-1)
        if rules.nucleus if per_row else rules.top_p < 1:
            valid = jnp.arange(candidates_k) < k
            probs = jnp.where(valid, jnp.exp(candidates - log_mass(kth)), 0.0)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            nucleus = jnp.where(valid & (mass_before < top_p), candidates, jnp.inf)
            kth = jnp.where(top_p < 1, jnp.min(nucleus, axis=-1, keepdims=True), kth)
        threshold = jnp.where(by_candidates, kth, threshold)
    if rules.nucleus if per_row else (rules.top_p < 1 and candidates_k == 0):
        row_values = lambda v: jnp.broadcast_to(v, top.shape).reshape(-1)
        found = pallas_kernels.top_p_threshold(
            logits.reshape(-1, V), row_values(_inverse_temperature(rules, logits.ndim)), row_values(top_p), backend=backend,
        ).reshape(top.shape)
        threshold = jnp.where(jnp.logical_and(top_p < 1, jnp.logical_not(by_candidates)), found, threshold)
    if per_row or rules.min_p > 0:
        threshold = jnp.maximum(threshold, top + jnp.log(min_p))  # min_p 0: log 0 = -inf keeps all
    return threshold, log_mass(threshold)


def probs_from_cutoff(logits: jax.Array, threshold: jax.Array, log_norm: jax.Array, rules: Rules) -> jax.Array:
    """Processed probabilities at the given logits (a whole row, or a few gathered tokens)."""
    x = tempered(logits, rules)
    return jnp.where(x >= threshold, jnp.exp(x - log_norm), 0.0)


def greedy_rows(rules: Rules, ndim: int) -> jax.Array | bool:
    """Whether each row is greedy (a config's answer for every row), broadcastable against `ndim` dims."""
    if isinstance(rules, SamplingConfig):
        return rules.greedy
    return _value(rules, "temperature", ndim) == 0


@functools.partial(jax.jit, static_argnames=("backend",))
def process_logits(logits: jax.Array, rules: Rules, backend: str = "reference") -> jax.Array:
    """Float32 probabilities over the last axis after the rules' processing: filtered tokens exactly
    0, the rest renormalised. Greedy (T = 0, the limit T -> 0) gives the one-hot of the first argmax."""
    one_hot = lambda: jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if rules.greedy:
        return one_hot()
    probs = probs_from_cutoff(logits, *cutoff(logits, rules, backend), rules)
    if isinstance(rules, SamplingConfig):
        return probs
    return jnp.where(greedy_rows(rules, logits.ndim), one_hot(), probs)


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """[rows] keys: `key` itself when it already holds one key per row, else split from it."""
    return key if key.ndim == 1 else jax.random.split(key, rows)


def split_rows(keys: jax.Array, n: int) -> jax.Array:
    """[n, B] keys: each row's key split n ways."""
    return jax.vmap(lambda k: jax.random.split(k, n), out_axes=1)(keys)


def uniform_rows(keys: jax.Array, shape: tuple[int, ...] = ()) -> jax.Array:
    """[B, *shape] float32 uniforms in [0, 1), row b's from keys[b]."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)


def gumbel_rows(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 Gumbel noise of `shape` [B, ...], row b from keys[b]."""
    return jax.vmap(lambda k: jax.random.gumbel(k, shape[1:], jnp.float32))(keys)


def draw(key: jax.Array, weights: jax.Array) -> jax.Array:
    """One int32 token per row of weights [B, ..., V], drawn with probability proportional to the
    non-negative weights (they need not sum to 1: the Gumbel-max draw normalises implicitly); `key`
    is one key per row or a single key."""
    keys = row_keys(key, weights.shape[0])
    return jax.vmap(lambda k, w: jax.random.categorical(k, jnp.log(w), axis=-1))(keys, weights).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("backend",))
def sample(key: jax.Array, logits: jax.Array, rules: Rules, backend: str = "reference") -> tuple[jax.Array, jax.Array | None]:
    """(tokens int32 [...], probs float32 [..., V] they were drawn from). Greedy configs return the
    first argmax of the raw logits and probs None, which `tree.tree_accept` reads as one-hot q."""
    if rules.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    probs = process_logits(logits, rules, backend)
    return draw(key, probs), probs


def expand(key, logits, b: int, sampling: Rules, backend: str):
    """A node's b children from its draft logits [B, n, V]: (tokens [B, n, b], q [B, n, V] or None when
    greedy). Sampling draws without replacement by Gumbel top-b, in draw order (b = 1: a plain draw);
    greedy rows (of row rules too) take the top-b logits. `key`: one per row."""
    if sampling.greedy:
        return top_indices(logits, b), None
    q = process_logits(logits, sampling, backend)
    perturbed = jnp.log(q) + gumbel_rows(key, q.shape)
    score = jnp.where(greedy_rows(sampling, q.ndim), logits.astype(jnp.float32), perturbed)
    return top_indices(score, b), q


def top_indices(x, b: int):
    """int32 indices of the b largest entries of x [..., V], largest first (ties: the lower index).
    Up to ARGMAX_PICKS of them are as many argmax reductions, each over x less the picks before it:
    cheaper than XLA's top-k sort over a whole vocabulary (bench/NOTES.md, "fewer kernels per
    layer", "where a 3,2 tree iteration's time goes")."""
    if b > ARGMAX_PICKS:
        return jax.lax.top_k(x, b)[1].astype(jnp.int32)
    x = jnp.maximum(x, jnp.finfo(x.dtype).min)  # -inf entries stay above the picked ones
    vocab, picks = jnp.arange(x.shape[-1]), []
    for _ in range(b):
        picks.append(jnp.argmax(x, axis=-1, keepdims=True).astype(jnp.int32))
        x = jnp.where(vocab == picks[-1], -jnp.inf, x)
    return jnp.concatenate(picks, axis=-1)
