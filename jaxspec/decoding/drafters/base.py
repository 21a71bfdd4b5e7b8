"""The drafter interface: what a drafter tells the engine, and the shared budget rule.

A drafter is one file with one `Drafter` subclass. The engine calls, per generation:
    init(cache, prompt_len)                 after prefill, before the last prompt token's step
    collect(num_rows)                       which verify rows' attention scores to gather (or None)
    capture()                               the model layers whose input stream the verify pass
                                            exports for every row (features; default none)
    after_verify(state, budget, scores, cache, first_pos, num_accepted, path)
                                            after every verification (and after the last prompt token,
                                            with one row and num_accepted 0) and after the accepted
                                            path's keys moved to slots first_pos + d: recompute the
                                            selection; `path` [B, depth + 1] are the accepted rows;
                                            `scores` is what the pass collected (the features with
                                            `capture`; (scores, features) with both)
The KV-selection policies draft with the model itself (`uses_model`: the engine runs the draft
forwards) and tell it, per draft forward:
    attend(state, budget, rows) -> (attend, layer_xs)
                                            the attention of one draft forward over `rows` (DraftRows:
                                            the tree nodes of one depth; one row for a chain)
    after_draft_step(state, cache, slots)   after each draft forward, slots [B, n] just written (e.g.
                                            metadata of written pages)
The others (n-gram lookup, the EAGLE head) set `uses_model = False` and draft the whole tree
themselves in `draft`. `budget` is the run-time `spec.Budget`; the capacity `k_max` is static.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.models.config import ModelConfig
from jaxspec.models.kvcache import KVCache
from jaxspec.models import decoder
from jaxspec.models.decoder import AttendFn
from jaxspec.decoding.spec import Budget, SpecConfig

State = Any


@dataclasses.dataclass(frozen=True)
class DraftRows:
    """The query rows of one draft forward: the nodes of one tree depth, all at position first + depth,
    node row r at slot first + r (traced inside the engine's scan over depths)."""

    first: jax.Array  # [B] slot (and position) of the root, the pending token
    depth: jax.Array  # [] int32
    rows: jax.Array  # [n] int32: the nodes' rows in the flattened tree
    ancestors: jax.Array  # [n, rows] bool: which tree rows each node sees (itself and its ancestors)
    chain: bool  # static: every earlier row is an ancestor (no mask needed)

    @property
    def position(self) -> jax.Array:
        """[B] the rows' common position."""
        return self.first + self.depth

    @property
    def slots(self) -> jax.Array:
        """[B, n] the rows' cache slots."""
        return self.first[:, None] + self.rows

    @property
    def mask(self) -> kernels.TreeMask | None:
        return None if self.chain else kernels.TreeMask(self.first, self.ancestors)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """Slots chosen from verification scores (`Drafter.select`): drafts attend them plus the tail."""

    idx: jax.Array  # [L, B, 1, k_max] selected slots per layer (first n_idx valid)
    n_idx: jax.Array  # [B]
    tail_start: jax.Array  # [B] first slot after the selection's prefix


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

    def capture(self) -> tuple[int, ...]:
        return ()

    def after_verify(
        self, state: State, budget: Budget, scores: Any, cache: KVCache, first_pos: jax.Array,
        num_accepted: jax.Array, path: jax.Array,
    ) -> State:
        return state

    def attend(self, state: State, budget: Budget, rows: DraftRows) -> tuple[AttendFn, Any]:
        raise NotImplementedError

    def after_draft_step(self, state: State, cache: KVCache, slots: jax.Array) -> State:
        return state

    def draft(self, params: Any, tokens: jax.Array, length: jax.Array, done: jax.Array, cache: KVCache, state: State,
              key: jax.Array, rules: Any) -> tuple[jax.Array, jax.Array | None, KVCache, State]:
        """Drafts of a drafter that runs no draft forward of the model (`uses_model` False): (tree tokens
        [B, rows], row 0 each row's pending token, the last of its committed `tokens` [B, N] (`length`
        [B] valid); the distributions [B, rows, V] each row's children were drawn from, None for
        one-hot; the cache; the state). `done` [B]: finished rows; `key`: one per row; `rules`: the
        sampling rules."""
        raise NotImplementedError

    def count(self, budget: Budget, context: jax.Array) -> jax.Array:
        """K = clamp(ceil(ratio * context), min_tokens, k_max), never more than `context` candidates."""
        k = jnp.ceil(budget.ratio * context.astype(jnp.float32)).astype(jnp.int32)
        return jnp.minimum(jnp.clip(k, budget.min_tokens, self.k_max), context)

    def select(self, budget: Budget, scores: jax.Array, last: jax.Array) -> Selection:
        """Top-K of `scores` [L, B, S] over candidate slots [0, last]; later slots are -inf already."""
        k = self.count(budget, last + 1)
        idx = kernels.select_topk(scores, self.k_max, k[None, :], backend=self.spec.backend)
        return Selection(idx[:, :, None, :], k, last + 1)

    def windowed(self, gates, n_idx: jax.Array, tail_start: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(selected count, tail start) of a layer's draft attention: on a sliding-window layer
        (gpt-oss's `decoder.SinkWindow`) no selection and its whole window as the tail, so drafts
        attend it as verification does; else as given. The window's reach is in `tail_reach`."""
        if not isinstance(gates, decoder.SinkWindow):
            return n_idx, tail_start
        return jnp.where(gates.sliding, 0, n_idx), jnp.where(gates.sliding, jnp.min(gates.lo, axis=1), tail_start)

    def tail_reach(self, tail_capacity: int) -> int:
        """A tail's static capacity, with room for a sliding window's keys on a model that has them."""
        return tail_capacity + (self.cfg.sliding_window if self.cfg.sliding_layers else 0)

    def sparse_attend(self, idx: jax.Array, n_idx: jax.Array, tail_start: jax.Array, rows: DraftRows,
                      tail_capacity: int, scale: float | None = None) -> tuple[AttendFn, Any]:
        """Draft attention over gathered slots `idx` ([L, B, Hs, K] per layer, or [B, Hs, K] for every
        layer) plus the tail from tail_start to each row's slot, of the tree's slots only the row's
        ancestors (`scale`: the model's by default). The kernel reads a layer stack at the layer in
        place (not through layer_xs, whose slice would be copied before it)."""

        slots, mask = rows.slots, rows.mask  # outside the layer loop: inside, XLA would recompute them every layer
        scale = self.scale if scale is None else scale

        def attend(layer, q, cache, _lx, gates, carry):
            n, start = self.windowed(gates, n_idx, tail_start)
            out = kernels.sparse_attention(
                q, cache.k, cache.v, cache.pages, layer, idx, n, start, slots, page_size=cache.page_size,
                scale=scale, tail_capacity=self.tail_reach(tail_capacity), tree=mask, skew=self.spec.balance,
                backend=self.spec.backend, **decoder.sink_window(gates),
            )
            return out, None, carry

        return attend, None
