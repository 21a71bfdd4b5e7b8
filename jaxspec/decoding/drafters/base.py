"""The drafter interface: what a KV-selection policy tells the engine, and the shared budget rule.

A policy is one file with one `Drafter` subclass. The engine calls, per generation:
    init(cache, prompt_len)                 after prefill, before the last prompt token's step
    collect(num_rows)                       which verify rows' attention scores to gather (or None)
    after_verify(state, budget, scores, cache, first_pos, num_accepted)
                                            after every verification (and after the last prompt token,
                                            with one row and num_accepted 0): recompute the selection
    attend(state, budget, q_pos) -> (attend, layer_xs)
                                            the attention of one draft step at positions q_pos [B]
    after_draft_step(state, cache, q_pos)   after each draft step (e.g. metadata of written pages)
Model-free drafters (n-gram) set `uses_model = False` and implement `propose` instead. `budget` is
the run-time `spec.Budget`; the capacity `k_max` is static.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.models.config import ModelConfig
from jaxspec.models.kvcache import KVCache
from jaxspec.models.decoder import AttendFn
from jaxspec.decoding.spec import Budget, SpecConfig

State = Any


@dataclasses.dataclass(frozen=True)
class Drafter:
    spec: SpecConfig
    cfg: ModelConfig
    k_max: int  # static selection capacity

    uses_model = True

    @property
    def scale(self) -> float:
        return self.cfg.head_dim**-0.5

    def init(self, cache: KVCache, prompt_len: jax.Array) -> State:
        return ()

    def collect(self, num_rows: int) -> kernels.Collect | None:
        return None

    def after_verify(
        self, state: State, budget: Budget, scores: Any, cache: KVCache, first_pos: jax.Array, num_accepted: jax.Array
    ) -> State:
        return state

    def attend(self, state: State, budget: Budget, q_pos: jax.Array) -> tuple[AttendFn, Any]:
        raise NotImplementedError

    def after_draft_step(self, state: State, cache: KVCache, q_pos: jax.Array) -> State:
        return state

    def propose(self, tokens: jax.Array, length: jax.Array) -> jax.Array:
        raise NotImplementedError

    def count(self, budget: Budget, context: jax.Array) -> jax.Array:
        """K = clamp(ceil(ratio * context), min_tokens, k_max), never more than `context` candidates."""
        k = jnp.ceil(budget.ratio * context.astype(jnp.float32)).astype(jnp.int32)
        return jnp.minimum(jnp.clip(k, budget.min_tokens, self.k_max), context)

    def sparse_attend(self, idx_layers: jax.Array, n_idx: jax.Array, tail_start: jax.Array, q_pos: jax.Array, tail_capacity: int) -> tuple[AttendFn, Any]:
        """Draft attention over per-layer gathered slots `idx_layers` [L, B, Hs, K] plus the tail [tail_start, q_pos]."""

        def attend(layer, q, cache, idx, _gates):
            out = kernels.sparse_attention(
                q[:, 0], cache.k, cache.v, layer, idx, n_idx, tail_start, q_pos,
                scale=self.scale, tail_capacity=tail_capacity, backend=self.spec.backend,
            )
            return out[:, None], None

        return attend, idx_layers
