"""Exact verification of drafted tokens (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).

Accepting draft x with probability min(1, p(x)/q(x)) and, at the first rejection, drawing from
norm(max(p - q, 0)) makes every emitted token follow the target's p exactly, whatever the drafter's q.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import SamplingConfig, cutoff, draw, probs_from_cutoff


def _accepted_prefix(accept: jax.Array) -> jax.Array:
    """Length of the leading run of True along axis 1, int32 [B]."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames="cfg")
def rejection_sample(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_logits: jax.Array,
    cfg: SamplingConfig,
) -> tuple[jax.Array, jax.Array]:
    """Verifies γ drafts per row against the target.

    draft_tokens [B, γ] int32; draft_probs [B, γ, V] float32, the processed distribution each draft
    was drawn from, or None for one-hot q (drafters without probabilities; ignored when greedy);
    target_logits [B, γ+1, V] raw target logits at the verified positions.
    Returns (num_accepted [B] int32 in [0, γ], tokens [B, γ+1] int32): the first num_accepted + 1
    tokens are emitted (the accepted drafts, then the recovered or bonus token); later ones are
    unspecified.
    """
    if cfg.greedy:
        # The target argmax is what plain greedy decoding emits; the accepted drafts equal it.
        target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
        return _accepted_prefix(draft_tokens == target[:, :-1]), target

    batch, gamma = draft_tokens.shape
    accept_key, draw_key = jax.random.split(key)
    threshold, log_norm = cutoff(target_logits, cfg)  # [B, γ+1, 1]
    at_drafts = jnp.take_along_axis(target_logits[:, :gamma], draft_tokens[..., None], axis=-1)
    p = probs_from_cutoff(at_drafts, threshold[:, :gamma], log_norm[:, :gamma], cfg)[..., 0]
    if draft_probs is None:
        q = jnp.ones_like(p)
    else:
        q = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    # u < p/q without dividing: q(x) = 0 (x could not have been drawn) accepts iff p(x) > 0.
    u = jax.random.uniform(accept_key, (batch, gamma))
    num_accepted = _accepted_prefix(u * q < p)

    # One draw per row at position num_accepted: the residual after a rejection, p at the bonus.
    def at_stop(x):
        return jnp.take_along_axis(x, num_accepted[:, None, None], axis=1)[:, 0]

    p_stop = probs_from_cutoff(at_stop(target_logits), at_stop(threshold), at_stop(log_norm), cfg)
    last = jnp.minimum(num_accepted, gamma - 1)[:, None]  # q at the rejected draft; unused at the bonus
    if draft_probs is None:
        rejected_draft = jnp.take_along_axis(draft_tokens, last, axis=1)[:, 0]
        q_stop = jax.nn.one_hot(rejected_draft, p_stop.shape[-1], dtype=jnp.float32)
    else:
        q_stop = jnp.take_along_axis(draft_probs, last[..., None], axis=1)[:, 0]
    rejected = (num_accepted < gamma)[:, None]
    residual = jnp.where(rejected, jnp.maximum(p_stop - q_stop, 0.0), p_stop)
    # Zero residual mass has probability 0 in exact arithmetic; fall back to p rather than to token 0.
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_stop)
    token = draw(draw_key, residual)

    drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
    return num_accepted, jnp.where(jnp.arange(gamma + 1) == num_accepted[:, None], token[:, None], drafts)
