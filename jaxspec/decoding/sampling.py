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

Top-p without top-k searches its threshold without sorting the vocabulary
(pallas_kernels/top_p.py): a kernel on the "pallas" backend, the same search in jnp on "reference".
The two round their sums differently, so a run uses one backend for every cutoff (plain steps,
drafts and targets): `backend` is the engine's kernel backend throughout.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxspec.errors import JaxspecError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen; frozen and hashable so it can be a static jit argument."""

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


def tempered(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Float32 logits times 1/T (sampling configs only). A product rounds the same wherever XLA puts
    it, so a threshold taken from some tempered values selects exactly those tokens everywhere."""
    return logits.astype(jnp.float32) * jnp.float32(1.0 / cfg.temperature)


def cutoff(logits: jax.Array, cfg: SamplingConfig, backend: str = "reference") -> tuple[jax.Array, jax.Array]:
    """(threshold, log_norm), each [..., 1], for a sampling config: token v is kept iff
    tempered(logits)[v] >= threshold, and then log p(v) = tempered(logits)[v] - log_norm.

    With top_k, top-p looks only at the k candidates of `lax.top_k` (a cumulative sum over k sorted
    values); without it, the kernel backend's sort-free nucleus search runs over the whole row. Both
    act on the raw logits, whose order the positive temperature preserves.
    """
    x = tempered(logits, cfg)
    top = jnp.max(x, axis=-1, keepdims=True)

    def log_mass(threshold):
        kept = jnp.where(x >= threshold, jnp.exp(x - top), 0.0)
        return top + jnp.log(jnp.sum(kept, axis=-1, keepdims=True))

    threshold = jnp.full_like(top, -jnp.inf)
    if 0 < cfg.top_k < logits.shape[-1]:
        candidates = tempered(jax.lax.top_k(logits, cfg.top_k)[0], cfg)  # descending
        threshold = candidates[..., -1:]
        if cfg.top_p < 1:
            probs = jnp.exp(candidates - log_mass(threshold))
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            nucleus = jnp.where(mass_before < cfg.top_p, candidates, jnp.inf)
            threshold = jnp.min(nucleus, axis=-1, keepdims=True)
    elif cfg.top_p < 1:
        rows = logits.reshape(-1, logits.shape[-1])
        found = pallas_kernels.top_p_threshold(rows, 1.0 / cfg.temperature, cfg.top_p, backend=backend)
        threshold = found.reshape(top.shape)
    if cfg.min_p > 0:
        threshold = jnp.maximum(threshold, top + math.log(cfg.min_p))
    return threshold, log_mass(threshold)


def probs_from_cutoff(
    logits: jax.Array, threshold: jax.Array, log_norm: jax.Array, cfg: SamplingConfig
) -> jax.Array:
    """Processed probabilities at the given logits (a whole row, or a few gathered tokens)."""
    x = tempered(logits, cfg)
    return jnp.where(x >= threshold, jnp.exp(x - log_norm), 0.0)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def process_logits(logits: jax.Array, cfg: SamplingConfig, backend: str = "reference") -> jax.Array:
    """Float32 probabilities over the last axis after cfg's processing: filtered tokens exactly 0,
    the rest renormalised. Greedy (T = 0, the limit T -> 0) gives the one-hot of the first argmax."""
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return probs_from_cutoff(logits, *cutoff(logits, cfg, backend), cfg)


def draw(key: jax.Array, weights: jax.Array) -> jax.Array:
    """One int32 token per row, drawn with probability proportional to the non-negative weights
    (they need not sum to 1: the Gumbel-max draw normalises implicitly)."""
    return jax.random.categorical(key, jnp.log(weights), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def sample(
    key: jax.Array, logits: jax.Array, cfg: SamplingConfig, backend: str = "reference"
) -> tuple[jax.Array, jax.Array | None]:
    """(tokens int32 [...], probs float32 [..., V] they were drawn from). Greedy returns the first
    argmax of the raw logits and probs None, which `tree.tree_accept` reads as one-hot q."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    probs = process_logits(logits, cfg, backend)
    return draw(key, probs), probs
