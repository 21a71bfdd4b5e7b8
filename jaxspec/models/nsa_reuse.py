"""Calibrating the refresh/reuse schedule of SSV's reuse precision classes.

A reuse layer takes the block selection of the nearest refresh layer before it and skips NSA's
compressed branch, which saves the compressed keys' read and the top-k per layer but changes the
model. The schedule is chosen greedily, as IndexCache does: starting from every layer refreshing,
each layer in turn (1, 2, ..., L - 1) becomes a reuse layer if the model with it stays within
`kl_bound` of the all-refresh model (mean KL of the next-token distributions, teacher-forced on local
text). One pass, L - 1 forward evaluations, each compiled once (the schedule is a traced mask). The
result is saved with the model (`nsa_refresh_layers` in config.json) and used only when a reuse
precision class is asked for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import decoder, nsa
from jaxspec.models.config import ModelConfig
from jaxspec.models.kvcache import init_cache


def schedule_logits(params, cfg: ModelConfig, tokens: jax.Array, refresh: jax.Array, backend: str = "reference"):
    """Teacher-forced float32 logits [B, T, V] of the NSA model over `tokens` [B, T] with the
    refresh/reuse schedule `refresh` [L] bool (True: the layer refreshes)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = init_cache(cfg, B, T)
    attend = nsa.attend_fn(cfg, positions, backend, refresh=refresh)
    hidden, _, _ = decoder.forward(params, cfg, tokens, positions, jnp.ones((B, T), bool), cache, attend,
                                   carry=nsa.initial_carry(cfg, positions, cache.num_slots, reuse=True), backend=backend)
    return decoder.logits(params, cfg, hidden)


@functools.lru_cache(maxsize=None)
def _kl_fn(cfg: ModelConfig, backend: str):
    def kl(params, tokens, reference_logp, refresh):
        logp = jax.nn.log_softmax(schedule_logits(params, cfg, tokens, refresh, backend), axis=-1)
        return jnp.mean(jnp.sum(jnp.exp(reference_logp) * (reference_logp - logp), axis=-1))

    return jax.jit(kl)


def calibrate(params, cfg: ModelConfig, tokens, kl_bound: float, backend: str = "reference", log=print):
    """The greedy schedule for `tokens` [N, T] (one row at a time): (refresh_layers, report) with the
    KL of every trial."""
    if cfg.nsa is None:
        raise ValueError("refresh/reuse schedules are for NSA models")
    L = cfg.num_layers
    rows = [jnp.asarray(row[None], jnp.int32) for row in np.asarray(tokens)]
    everything = jnp.ones(L, bool)
    reference = [jax.nn.log_softmax(schedule_logits(params, cfg, row, everything, backend), axis=-1) for row in rows]
    kl_fn = _kl_fn(cfg, backend)
    refresh = np.ones(L, bool)
    trials, kl_kept = [], 0.0
    for layer in range(1, L):
        trial = refresh.copy()
        trial[layer] = False
        kl = float(np.mean([kl_fn(params, row, ref, jnp.asarray(trial)) for row, ref in zip(rows, reference)]))
        keep = kl <= kl_bound
        trials.append({"layer": layer, "kl": kl, "reuse": keep})
        log(f"layer {layer:3d}: KL {kl:.4f} -> {'reuse' if keep else 'refresh'}")
        if keep:
            refresh, kl_kept = trial, kl
    layers = tuple(int(i) for i in np.flatnonzero(refresh))
    report = {"kl_bound": kl_bound, "kl": kl_kept, "refresh_layers": list(layers), "reuse_layers": L - len(layers),
              "tokens": list(np.asarray(tokens).shape), "trials": trials}
    return layers, report
