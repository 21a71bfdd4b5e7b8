"""Quest: query-aware page selection per KV head from per-page key bounds.

Each 16-slot page keeps the elementwise min and max of its keys per KV head. A page's score for the
current query is sum_d max(q_d * kmax_d, q_d * kmin_d), summed over the query heads of the group; the
top pages per KV head (kernels.quest_pages: scores and top-k in one kernel) are attended together
with the query's own (last) page. The first two layers attend densely, as in the Quest paper. The
nodes of one draft-tree depth share one page choice, scored with all their queries (summed as the
heads of a group are); their tail starts at the root's page.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.decoding.drafters.base import Drafter
from jaxspec.models import decoder
from jaxspec.models.kvcache import KVCache
from jaxspec.decoding.spec import PAGE
from pallas_kernels import paging

DENSE_LAYERS = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageBounds:
    """Pools [L, Hkv, N // PAGE, Dh] beside the cache's [L, Hkv, N, Dh], under its page table: pool
    entry e bounds pool slots e * PAGE .. e * PAGE + PAGE - 1 (`kernels.quest_pages`)."""
    kmin: jax.Array
    kmax: jax.Array


class Quest(Drafter):
    def init(self, cache, prompt_len):
        L, H, N, D = cache.k.shape
        pages = cache.k.reshape(L, H, N // PAGE, PAGE, D)  # a free reshape: pool entries are whole pages
        return PageBounds(pages.min(axis=3), pages.max(axis=3))

    def after_verify(self, state, budget, scores, cache, first_pos, num_accepted, path):
        slots = first_pos[:, None] + jnp.arange(self.spec.shape.rows, dtype=jnp.int32)
        return self.refresh(state, cache, slots)

    def after_draft_step(self, state, cache, slots):
        return self.refresh(state, cache, slots)

    def refresh(self, state: PageBounds, cache: KVCache, slots: jax.Array) -> PageBounds:
        """Recomputes the bounds of the pages holding logical `slots` [B, m] (just written) in every
        layer (slots past the table: the null page's, never read)."""
        entry = paging.physical(cache.pages, slots // PAGE, cache.page_size // PAGE)  # [B, m] pool entries
        keys = cache.k[:, :, entry[..., None] * PAGE + jnp.arange(PAGE)]  # [L, Hkv, B, m, PAGE, Dh]
        kmin = state.kmin.at[:, :, entry].set(keys.min(axis=4))
        kmax = state.kmax.at[:, :, entry].set(keys.max(axis=4))
        return PageBounds(kmin, kmax)

    def attend(self, state, budget, rows):
        B = rows.slots.shape[0]
        last_page = rows.first // PAGE
        # Pages before the root's page; the root's page onwards is the tail.
        n_pages = jnp.minimum(-(-self.count(budget, rows.position + 1) // PAGE) - 1, last_page)
        offsets = jnp.arange(PAGE, dtype=jnp.int32)

        def sparse(layer, q, cache, idx, extras, n, start):
            return kernels.sparse_attention(
                q, cache.k, cache.v, cache.pages, layer, idx, n, start, rows.slots, page_size=cache.page_size,
                scale=self.scale, tail_capacity=self.tail_reach(PAGE + self.spec.shape.rows), tree=rows.mask,
                skew=self.spec.balance, backend=self.spec.backend, **extras,
            )

        def dense(layer, q, cache, idx, extras, n, start):
            out, _, _ = kernels.verify_attention(
                q, cache.k, cache.v, cache.pages, layer, rows.slots, page_size=cache.page_size, scale=self.scale,
                tree=rows.mask, backend=self.spec.backend, **extras,
            )
            return out

        def attend(layer, q, cache, _lx, gates, carry):
            # The pages are chosen outside the cond, also for the dense layers: a cond takes its
            # operands by value, so inside it each layer's bounds would be copied first (bench/NOTES.md,
            # "the planner's table found again"). The bound pools are read at the layer in place.
            top = kernels.quest_pages(q, state.kmin, state.kmax, cache.pages, layer, last_page, jnp.maximum(n_pages, 1),
                                      self.k_max // PAGE, page_size=cache.page_size, backend=self.spec.backend)
            idx = (top[..., None] * PAGE + offsets).reshape(B, self.cfg.num_kv_heads, -1)
            n, start = self.windowed(gates, n_pages * PAGE, last_page * PAGE)
            out = jax.lax.cond(layer < DENSE_LAYERS, dense, sparse, layer, q, cache, idx, decoder.sink_window(gates), n,
                               start)
            return out, None, carry

        return attend, None
