"""The decoding engine: prefill, then one `lax.while_loop` of draft -> verify -> accept -> update.

Everything is pure and static-shaped (batch, cache length, draft tree, selection capacity); lengths,
positions and acceptance are traced, and no Python runs per iteration (on a GPU the host still reads
the loop's condition each iteration, which leaves the GPU idle only briefly: bench/NOTES.md, "Decode
step"). Rows finish independently (stop ids, max tokens) and finished rows
stop changing and stop reading their context: a static batch keeps them until its last row is done,
so their passes run at slot 0 and write nothing (`roots`), unless its caller moves the unfinished rows
into a smaller batch (`Engine.decode`'s `min_live`, `take_rows`: the serving scheduler's `shrink`).

State invariant between iterations: row b has committed `length[b]` tokens; the KV cache holds every
committed token but the last one (the pending token), whose keys the next pass writes. Plain decoding
is the same loop with no drafts.

Every drafting method drafts a tree (`decoding.tree`; a chain of gamma drafts is the tree of widths
1, ..., 1). Its rows (row 0 the pending token, then the nodes in flattened order) sit at cache slots
first + row, where first is the pending token's slot, and at positions first + depth (RoPE); each row
attends the committed cache and its own ancestors. After acceptance the accepted path's keys are moved
to consecutive slots (a no-op for chains), so the invariant above holds again.

Sampling is either one static `SamplingConfig` for the whole batch (`sampling`, the CLI's) or, with
`sampling=None`, each row's own rules in `state.sampling` (a server's rows). Every row has its own key.
Continuous batching: `admit` prefills new requests into chosen rows of a running state between
segments of the loop (`decode` with `max_iterations`), `release` frees rows; the loop is unchanged.

`Engine` holds what every step of one run shares (model config, strategy, sampling mode, length cap)
and runs prefill, start, decode, admit, switch and generate with only the traced arguments.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

import numpy as np

import pallas_kernels as kernels
from jaxspec.models import decoder, draft_weights, eagle, kvcache, nsa
from jaxspec.models.config import ModelConfig
from jaxspec.decoding.drafters import Drafter, DraftRows, make_drafter
from jaxspec.models.eagle import EagleConfig
from jaxspec.models.kvcache import KVCache
from jaxspec.decoding.sampling import Rules, RowSampling, SamplingConfig, expand, row_keys, sample, split_rows
from jaxspec.decoding.spec import Budget, SpecConfig
from jaxspec.decoding.tree import MAX_TREE_ROWS, TreeShape, tree_accept


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecStats:
    """Per-row counters over decode iterations (the first token, sampled at prefill, is not one)."""

    iterations: jax.Array  # [B]
    drafted: jax.Array  # [B] draft nodes verified
    accepted: jax.Array  # [B] drafts accepted by verification
    accepted_by_depth: jax.Array  # [B, depth]: iterations in which a draft of depth d + 1 was accepted


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens: jax.Array  # [B, max_len + gamma + 1] prompt then generated tokens
    length: jax.Array  # [B] committed tokens
    prompt_len: jax.Array  # [B]
    stop_len: jax.Array  # [B] length at which the row stops (prompt + max new tokens, <= max_len)
    done: jax.Array  # [B] bool
    stop_ids: jax.Array  # [B, n] token ids that end each row (-1: none)
    budget: Budget  # run-time sparse budget (ratio, min_tokens)
    cache: KVCache
    drafter: Any
    key: jax.Array  # [B] one key per row: a row's draws depend on its key alone
    stats: SpecStats
    sampling: RowSampling | None  # each row's sampling rules, or None: the static config's for all


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    tokens: jax.Array  # [B, max_len]: prompt, generated tokens, then padding
    length: jax.Array  # [B]
    prompt_len: jax.Array  # [B]
    stats: SpecStats


@dataclasses.dataclass(frozen=True)
class Engine:
    """The decode program of one model, strategy, sampling mode and length cap: the static bundle
    that every step shares, with methods that take only traced arguments. Frozen and hashable, so a
    caller's own `jax.jit` can close over it or take it as a static argument:

        eng = Engine(cfg, spec, SamplingConfig(), max_len)
        out = jax.jit(eng.generate)(params, ids, lengths, key, max_new_tokens=64, stop_ids=eos)

    `sampling`: the static config of every row, or None with each row's rules in the state
    (`row_sampling`: a server's rows). `spec.compiled(max_len)` gives runs that differ only in their
    budget one program (pass `spec.budget()` where a method takes a budget)."""

    cfg: ModelConfig
    spec: SpecConfig
    sampling: SamplingConfig | None
    max_len: int

    def prefill_cache(self, params: decoder.Params, prompts: jax.Array, prompt_len: jax.Array,
                      cache: KVCache | None = None, begin: jax.Array | None = None) -> KVCache:
        """`prefill_cache` on this engine's backend and prefill chunk."""
        return prefill_cache(params, prompts, prompt_len, cfg=self.cfg, max_len=self.max_len, backend=self.spec.backend,
                             chunk=self.spec.prefill_chunk, head=self.spec.eagle, cache=cache, begin=begin)

    def start(
        self,
        params: decoder.Params,
        cache: KVCache,
        prompts: jax.Array,
        prompt_len: jax.Array,
        key: jax.Array,
        budget: Budget,
        *,
        max_new_tokens: jax.Array | int,
        stop_ids: jax.Array,
        row_sampling: RowSampling | None = None,
    ) -> DecodeState:
        """Samples each row's first token from its last prompt token, given the `prefill_cache` output.

        The last prompt token runs as a one-row verification, whose attention scores seed the drafter's
        first selection. `budget` (traced: `SpecConfig.budget()`) is the sparse budget of this run.
        `key`: a single key or one per row [B]; `max_new_tokens`: one or per row [B]; `stop_ids`: [n]
        for every row or [B, n] per row (-1 pads); `row_sampling`: each row's rules when `sampling` is None.
        """
        cfg, spec, max_len = self.cfg, self.spec, self.max_len
        B, P = prompts.shape
        stop_ids = jnp.asarray(stop_ids, jnp.int32)
        gamma = spec.draft_len
        drafter = make_drafter(spec, cfg, max_len)
        tokens = jnp.zeros((B, max_len + gamma + 1), jnp.int32).at[:, :P].set(prompts.astype(jnp.int32))
        zeros = jnp.zeros((B,), jnp.int32)
        state = DecodeState(
            tokens=tokens,
            length=prompt_len.astype(jnp.int32),
            prompt_len=prompt_len.astype(jnp.int32),
            stop_len=jnp.minimum(prompt_len + max_new_tokens, max_len).astype(jnp.int32),
            done=jnp.zeros((B,), bool),
            stop_ids=jnp.broadcast_to(stop_ids, (B, stop_ids.shape[-1])),
            budget=budget,
            cache=cache,
            drafter=drafter.init(cache, prompt_len) if drafter else (),
            key=row_keys(key, B),
            stats=SpecStats(zeros, zeros, zeros, jnp.zeros((B, gamma), jnp.int32)),
            sampling=row_sampling,
        )
        first = _plain_step(params, cfg, spec, self.sampling, drafter, state)
        return dataclasses.replace(first, stats=state.stats)

    def prefill(self, params, prompts, prompt_len, key, *, max_new_tokens, stop_ids, budget: Budget | None = None,
                row_sampling: RowSampling | None = None) -> DecodeState:
        """`prefill_cache` then `start` (under `spec.budget()` unless a budget is given)."""
        cache = self.prefill_cache(params, prompts, prompt_len)
        return self.start(params, cache, prompts, prompt_len, key, self.spec.budget() if budget is None else budget,
                          max_new_tokens=max_new_tokens, stop_ids=stop_ids, row_sampling=row_sampling)

    def decode(
        self,
        params: decoder.Params,
        state: DecodeState,
        *,
        max_iterations: jax.Array | int | None = None,
        min_live: jax.Array | int = 0,
    ) -> DecodeState:
        """Iterates until every row is done (or `max_iterations` more iterations, to run in segments; or
        until at most `min_live` rows are unfinished, so a caller can shrink the batch: `take_rows`).
        With `spec.select_every` N > 1 it runs whole groups of N iterations, so a segment may run up to
        N - 1 iterations past `max_iterations`, and every segment ends with a selection."""
        cfg, spec, sampling = self.cfg, self.spec, self.sampling
        drafter = make_drafter(spec, cfg, self.max_len)
        limit = jnp.iinfo(jnp.int32).max if max_iterations is None else max_iterations

        def cond(carry):
            state, i = carry
            return (jnp.sum(~state.done) > min_live) & (i < limit)

        def body(carry):  # a group of spec.select_every iterations, the last of which selects
            state, i = carry
            if drafter is None:
                return _plain_step(params, cfg, spec, sampling, drafter, state), i + 1
            for n in range(spec.select_every):
                state = _spec_step(params, cfg, spec, sampling, drafter, state, select=n == spec.select_every - 1)
            return state, i + spec.select_every

        state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
        return state

    def admit(
        self,
        params: decoder.Params,
        state: DecodeState,
        slots: jax.Array,
        prompts: jax.Array,
        prompt_len: jax.Array,
        key: jax.Array,
        max_new_tokens: jax.Array,
        stop_ids: jax.Array,
        row_sampling: RowSampling | None = None,
        *,
        pages: jax.Array,
        begin: jax.Array,
        prefilled: bool = False,
    ) -> DecodeState:
        """Continuous batching: prefills n new requests (prompts [n, P], keys [n], max_new_tokens [n],
        stop_ids [n, m], row_sampling of n rows) into the state's KV pool under their page tables
        `pages` [n, R] and writes them into rows `slots` [n] of a running state, leaving its other rows
        as they were. A server admits requests into freed slots between loop segments; each new row is
        what `prefill` makes of it (first token drawn, drafter seeded, stats zero), under the state's
        budget. begin [n]: the positions already in the pool (a cached prefix, shared read-only: the
        prefill writes from there on). `prefilled`: the prompts' KV is written already (by
        `prefill_chunk`, a chunk per round), so only `start` remains."""
        cache = state.cache.with_pages(pages)
        if not prefilled:
            cache = self.prefill_cache(params, prompts, prompt_len, cache, begin)
        rows = self.start(params, cache, prompts, prompt_len, key, state.budget, max_new_tokens=max_new_tokens,
                          stop_ids=stop_ids, row_sampling=row_sampling)
        return write_rows(state, rows, slots)

    def switch(self, params: decoder.Params, state: DecodeState, budget: Budget) -> DecodeState:
        """Continues a running decode (of any strategy) under this engine's strategy (the planner's
        switch, `--method auto`).

        Keeps the committed tokens, lengths, KV cache, key, done flags and stop rules; `tokens` takes the
        new draft length's width. The cache layout does not depend on the strategy and holds every
        committed token but the pending one, as after prefill, so the new drafter starts from `init` and
        is seeded as `start` seeds it: one plain step, a one-row verification of the pending token whose
        scores give the drafter its first selection and whose token is drawn from the target, so the
        output distribution is unchanged. `budget` is the new spec's (traced, as in `start`). Stats start
        again at zero (the caller sums them over strategies).
        """
        spec, max_len = self.spec, self.max_len
        if spec.method == "eagle":
            raise ValueError("a run cannot switch to eagle: the head's cache covers only what it drafted over")
        B = state.length.shape[0]
        drafter = make_drafter(spec, self.cfg, max_len)
        tokens = jnp.zeros((B, max_len + spec.draft_len + 1), jnp.int32).at[:, :max_len].set(state.tokens[:, :max_len])
        zeros = jnp.zeros((B,), jnp.int32)
        stats = SpecStats(zeros, zeros, zeros, jnp.zeros((B, spec.draft_len), jnp.int32))
        state = dataclasses.replace(
            state, tokens=tokens, budget=budget, stats=stats,
            drafter=drafter.init(state.cache, state.length) if drafter else (),
        )
        return dataclasses.replace(_plain_step(params, self.cfg, spec, self.sampling, drafter, state), stats=stats)

    def generate(self, params: decoder.Params, prompts: jax.Array, prompt_len: jax.Array, key: jax.Array, *,
                 max_new_tokens: jax.Array | int, stop_ids: jax.Array) -> GenerateOutput:
        """Prefill and decode in one traceable function (jit it, or call it inside your own jit)."""
        state = self.prefill(params, prompts, prompt_len, key, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        return finish(self.decode(params, state), self.max_len)


def prefill_cache(
    params: decoder.Params,
    prompts: jax.Array,
    prompt_len: jax.Array,
    *,
    cfg: ModelConfig,
    max_len: int,
    backend: str = "reference",
    chunk: int = 256,
    head: EagleConfig | None = None,
    cache: KVCache | None = None,
    begin: jax.Array | None = None,
) -> KVCache:
    """A cache holding the KV of every prompt token but the last, filled `chunk` positions at a time.

    prompts [B, P] are right-padded; prompt_len [B] in [1, max_len). The cache has room for max_len
    plus any draft tree, so one prefill serves every decoding method (tests and benchmarks reuse it);
    with an EAGLE-3 `head` (weights in params["eagle"]) it holds the head's cache over the prompt too,
    which only method eagle needs. `cache`: write into this one instead (a server's pool under the
    rows' page tables), from positions begin [B] on (the rows' cached prefixes: default 0).
    """
    B, P = prompts.shape
    if P > max_len:
        raise ValueError(f"prompts of {P} tokens do not fit max_len {max_len}")
    if cache is None:
        cache = init_cache(cfg, B, max_len + MAX_TREE_ROWS, head)
    chunk = min(chunk, P)
    fill = functools.partial(prefill_chunk, params, prompts=prompts, prompt_len=prompt_len, cfg=cfg, backend=backend,
                             chunk=chunk, head=head)
    if begin is None:
        return jax.lax.fori_loop(0, -(-(P - 1) // chunk), lambda c, cache: fill(cache, begin=c * chunk), cache)
    num_chunks = (jnp.max(prompt_len - 1 - begin) + chunk - 1) // chunk  # the longest rest; a cached row may have none
    return jax.lax.fori_loop(0, num_chunks, lambda c, cache: fill(cache, begin=begin + c * chunk), cache)


def prefill_chunk(
    params: decoder.Params,
    cache: KVCache,
    *,
    prompts: jax.Array,
    prompt_len: jax.Array,
    begin: jax.Array | int,
    cfg: ModelConfig,
    backend: str,
    chunk: int,
    head: EagleConfig | None = None,
) -> KVCache:
    """`cache` with the KV of prompt positions [begin, begin + chunk) written (positions before each
    row's last token; the others are not written), the `head`'s too (an EAGLE-3 head: the target's
    features at each position with the next prompt token). `begin`: one for every row, or one a row
    [B]. Chunks in order from 0 make `prefill_cache`; a server prefills a long prompt a chunk per round
    between decode segments (chunked prefill)."""
    # The prompts write and read only slots below their width: the chunk sees just the pages under it,
    # so attention that reads a row's whole table (the reference, for chunks of more than 64 rows) costs
    # the prompt's length, not the cache's.
    table = cache.pages
    cache = cache.with_pages(table[:, : -(-prompts.shape[1] // cache.page_size)])
    begin = jnp.reshape(jnp.asarray(begin, jnp.int32), (-1, 1))
    positions = jnp.broadcast_to(begin + jnp.arange(chunk, dtype=jnp.int32), (prompts.shape[0], chunk))
    # positions past the prompts' width read its last column: they are not valid, so they write nothing
    prompt_at = lambda p: jnp.take_along_axis(prompts.astype(jnp.int32), jnp.minimum(p, prompts.shape[1] - 1), axis=1)
    valid = positions < (prompt_len - 1)[:, None]
    attend = decoder.attention(cfg, jnp.minimum(positions, cache.num_slots - 1), backend)
    capture = () if head is None else head.feature_layers
    _, cache, _, *features = decoder.forward(params, cfg, prompt_at(positions), positions, valid, cache, attend,
                                             backend=backend, capture=capture)
    if head is not None:
        _, head_cache = eagle.feature_forward(params["eagle"], head, params, cfg, prompt_at(positions + 1), features[0],
                                              positions, valid, cache.head, backend)
        cache = dataclasses.replace(cache, head=head_cache)
    return cache.with_pages(table)


def init_cache(cfg: ModelConfig, batch: int, length: int, head: EagleConfig | None = None,
               page_size: int = kvcache.DEFAULT_PAGE_SIZE, num_pages: int | None = None) -> KVCache:
    """The model's empty cache of `length` slots a row, with an EAGLE-3 `head`'s own beside it under
    the same page table. `num_pages` None: each row on its own consecutive pages (a batch); given: a
    server's pool of that many pages, every row's table on the null page until it is given pages."""
    if num_pages is None:
        cache = kvcache.init_cache(cfg, batch, length, page_size)
        heads = None if head is None else eagle.init_cache(head, batch, length, cfg.dtype, page_size)
    else:
        pages = jnp.zeros((batch, kvcache.cache_slots(length, page_size) // page_size), jnp.int32)
        cache = kvcache.init_pool(cfg, pages, num_pages, page_size)
        heads = None if head is None else eagle.init_pool(head, pages, num_pages, cfg.dtype, page_size)
    return cache if head is None else dataclasses.replace(cache, head=heads)


def finish(state: DecodeState, max_len: int) -> GenerateOutput:
    return GenerateOutput(state.tokens[:, :max_len], state.length, state.prompt_len, state.stats)


def write_rows(state: DecodeState, rows: DecodeState, slots: jax.Array) -> DecodeState:
    """`state` with rows `slots` [n] replaced by the n rows of `rows` (a state of the same static
    configuration, made in the same KV pool: `Engine.admit`). Leaves of the whole batch come from
    `rows`: the pools its rows were written into, and the budget it was started under (the state's).
    With n = B every row is replaced, and `slots` must be 0, ..., B - 1. A slot index of B or more
    drops its row (padding rows of a bucketed admission)."""

    def put(old, new):
        axis = _batch_axis(old, new)
        if axis is None:
            return new
        return old.at[(slice(None),) * axis + (slots,)].set(new, mode="drop")

    return jax.tree.map(put, state, rows)


def take_rows(state: DecodeState, rows: jax.Array, like: DecodeState) -> DecodeState:
    """The state of rows `rows` [n] of `state`, in that order: a batch shrunk to its unfinished rows
    (a finished row's iteration still costs most of a live one's: bench/NOTES.md, "a batch that
    shrinks as its rows finish"). `like`
    is a state of n rows, or its shapes (`jax.eval_shape`), with n != B: it tells each leaf's batch
    axis. Every row goes on exactly as it would have in the whole batch: its draws depend on its own
    key alone, and its passes read only its own cache row."""
    return jax.tree.map(lambda old, new: old if (a := _batch_axis(old, new)) is None else jnp.take(old, rows, axis=a),
                        state, like)


def _batch_axis(a, b) -> int | None:
    """A leaf's batch axis, from its shapes in two states of different batch sizes: the one axis
    whose size differs (the drafters' states need no description of their layouts). None: the leaf
    belongs to the whole batch (the budget)."""
    axes = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if len(axes) > 1:
        raise ValueError(f"leaves of shapes {a.shape} and {b.shape} differ in more than the batch axis")
    return axes[0] if axes else None


def release(state: DecodeState, free: jax.Array) -> DecodeState:
    """Marks rows done (free [B] bool: cancelled requests, stop strings found by the host, preempted
    ones); a done row stops changing and its slot can take the next request (`Engine.admit`). Its page
    table row points at the null page from now on, so the host may hand its pages to others."""
    pages = jnp.where(free[:, None], kvcache.NULL_PAGE, state.cache.pages)
    return dataclasses.replace(state, done=state.done | free, cache=state.cache.with_pages(pages))


def _plain_step(params, cfg, spec, sampling, drafter: Drafter | None, state: DecodeState) -> DecodeState:
    """One token per row: a one-row verification of the pending token, then a draw from the target."""
    logits, cache, scores = verify(params, cfg, spec, drafter, state, pending_tokens(state)[:, None], None)
    key, sub = split_rows(state.key, 2)
    token, _ = sample(sub, logits[:, 0], rules(sampling, state), spec.backend)
    num_accepted = jnp.zeros_like(state.length)
    path = jnp.zeros((token.shape[0], 1), jnp.int32)
    return _commit(state, cache, key, token[:, None], num_accepted, path, drafter, scores, nodes=0)


def _spec_step(params, cfg, spec, sampling, drafter: Drafter, state: DecodeState, select: bool = True) -> DecodeState:
    """Draft a tree, verify it in one pass, accept exactly, move the accepted path's keys into place,
    update the selection (`select` False: keep it, and collect no scores; `SpecConfig.select_every`)."""
    tree = spec.shape
    key, draft_key, accept_key = split_rows(state.key, 3)
    if drafter.uses_model:
        tokens, draft_probs, state = draft(params, cfg, spec, sampling, drafter, state, draft_key)
    else:
        tokens, draft_probs, cache, dstate = drafter.draft(params, state.tokens, state.length, state.done, state.cache,
                                                           state.drafter, draft_key, rules(sampling, state))
        state = dataclasses.replace(state, cache=cache, drafter=dstate)
    selector = drafter if select else None  # None: verification collects no scores, the selection stays
    logits, cache, scores = verify(params, cfg, spec, selector, state, tokens, tree)
    num_accepted, path, emitted = tree_accept(accept_key, tree, tokens, draft_probs, logits, rules(sampling, state),
                                              spec.backend)
    cache = compact(cache, roots(state.length, state.done), path, tree, ~state.done)
    return _commit(state, cache, key, emitted, num_accepted, path, selector, scores, nodes=tree.rows - 1)


def draft(params, cfg, spec, sampling, drafter, state, key):
    """Drafts `spec`'s tree with the target model (reading the draft's quantized copies and leaving
    out its skipped layers: `models.draft_weights`) over the drafter's KV subset: one forward per
    depth, whose rows are that depth's nodes; each node's children are its top-b draft tokens (greedy, or
    `spec.draw_mode` "top") or b tokens drawn from its draft distribution without replacement (Gumbel top-b).

    Returns (tokens [B, rows]: row 0 the pending token, then every node's draft; their distributions
    [B, rows, V], row r the one r's children were drawn from, or None for top-b children; the state
    with the drafted rows' KV written and the drafter's per-step state updated).
    """
    tree = spec.shape
    sampling = spec.draft_rules(rules(sampling, state))
    params, layer_ids = draft_weights.draft_params(params, spec.draft_weights, spec.draft_skip, spec.backend)
    B = state.length.shape[0]
    first, live = roots(state.length, state.done), ~state.done
    budget = row_budget(spec, state.budget, state.stats, state.done)
    tokens = jnp.zeros((B, tree.rows), jnp.int32).at[:, 0].set(pending_tokens(state))
    probs = None if sampling.greedy else jnp.zeros((B, tree.rows, cfg.vocab_size), jnp.float32)
    carry = (tokens, probs, state.cache, state.drafter, key)
    for depths in tree.draft_segments():  # runs of equal (parents, width): one scan each
        rows = np.stack([tree.parents_at(d) for d in depths])  # [steps, n]
        xs = (jnp.asarray(depths, jnp.int32), jnp.asarray(rows), jnp.asarray(tree.kids(rows)),
              jnp.asarray(tree.ancestors[rows]))

        def step(carry, x):
            tokens, probs, cache, dstate, key = carry
            depth, rows, kids, ancestors = x
            at = DraftRows(first, depth, rows, ancestors, tree.is_chain)
            attend, layer_xs = drafter.attend(dstate, budget, at)
            if layer_ids is not None:  # the selection of the layers the draft runs
                layer_xs = jax.tree.map(lambda a: a[layer_ids], layer_xs)
            n = rows.shape[0]
            hidden, cache, _ = decoder.forward(
                params, cfg, tokens[:, rows], jnp.broadcast_to(at.position[:, None], (B, n)), jnp.broadcast_to(live[:, None], (B, n)),
                cache, attend, layer_xs, slots=at.slots, layer_ids=layer_ids, backend=spec.backend,
            )
            key, sub = split_rows(key, 2)
            children, q = expand(sub, decoder.logits(params, cfg, hidden), kids.shape[1], sampling, spec.backend)
            tokens = tokens.at[:, kids].set(children, mode="drop")  # a node's missing children: dropped
            probs = None if q is None else probs.at[:, rows].set(q)
            dstate = drafter.after_draft_step(dstate, cache, at.slots)
            return (tokens, probs, cache, dstate, key), None

        carry, _ = jax.lax.scan(step, carry, xs)
    tokens, probs, cache, dstate, _ = carry
    return tokens, probs, dataclasses.replace(state, cache=cache, drafter=dstate)


def verify(params, cfg, spec, drafter, state, tokens, tree: TreeShape | None):
    """Target attention over the pending token and a drafted tree (tokens [B, rows]; tree None: the
    pending token alone, plain decoding): row t at slot first + t and position first + depth(t),
    attending the committed cache and its ancestors. NSA targets verify as `spec`'s precision class
    and group say (SSV: `models.nsa.Verification`); dense targets ignore them.

    Returns float32 logits [B, rows, V], the cache with the rows' exact KV, and what the drafter
    asked the pass for: its selection scores (per layer, `collect`), the rows' features (`capture`),
    both as (scores, features), or None.
    """
    T = tokens.shape[1]
    first = roots(state.length, state.done)
    slots = first[:, None] + jnp.arange(T, dtype=jnp.int32)
    positions = slots if tree is None else first[:, None] + jnp.asarray(tree.node_depth)
    mask = None if tree is None or tree.is_chain else kernels.TreeMask(first, tree.ancestors)
    collect = None if drafter is None else drafter.collect(T)
    capture = () if drafter is None else drafter.capture()
    verification = nsa.Verification(spec.group, spec.shared_index, spec.reuse_layers)
    attend = decoder.attention(cfg, slots, spec.backend, collect, tree=mask, verification=verification)
    hidden, cache, scores, *features = decoder.forward(
        params, cfg, tokens, positions, jnp.broadcast_to(~state.done[:, None], tokens.shape), state.cache, attend, slots=slots,
        carry=decoder.attention_carry(cfg, slots, state.cache.num_slots, verification), backend=spec.backend,
        capture=capture,
    )
    collected = (scores, features[0]) if capture and collect else features[0] if capture else scores
    return decoder.logits(params, cfg, hidden), cache, collected


def compact(cache: KVCache, first: jax.Array, path: jax.Array, tree: TreeShape, live: jax.Array) -> KVCache:
    """Moves the accepted path's keys and values (slots first + path[d]) to slots first + d; a
    chain's path is already in place, and a finished row (live [B] false) moves nothing. Entries past
    the accepted length are left for the next pass to overwrite."""
    if tree.is_chain:
        return cache
    dst = first[:, None] + jnp.arange(path.shape[1], dtype=jnp.int32)
    return cache.move(jnp.where(live[:, None], first[:, None] + path, dst), dst)


def rules(sampling: SamplingConfig | None, state: DecodeState) -> Rules:
    """The sampling rules of a step: the static config, or (None) each row's own from the state."""
    return state.sampling if sampling is None else sampling


def row_budget(spec: SpecConfig, budget: Budget, stats: SpecStats, done: jax.Array) -> Budget:
    """The budget each row's drafter uses: the run's, shared among the unfinished rows by the drafts
    each has lost so far when `spec.balance` > 1 (`Budget.shared`)."""
    lost = stats.iterations * stats.accepted_by_depth.shape[1] - stats.accepted
    return budget.shared(lost, stats.iterations, ~done, spec.balance)


def roots(length: jax.Array, done: jax.Array) -> jax.Array:
    """Each row's root slot [B] (length, done [B]), where its next pass starts: the pending token's,
    length - 1. A finished row runs at slot 0 instead and writes nothing, so its attention reads one key block and
    its drafter selects one slot rather than its whole context (bench/NOTES.md, "finished rows stop
    reading their context")."""
    return jnp.where(done, 0, length - 1)


def pending_tokens(state: DecodeState) -> jax.Array:
    """Each row's last committed token [B], whose keys the next pass writes."""
    return jnp.take_along_axis(state.tokens, (state.length - 1)[:, None], axis=1)[:, 0]


def _commit(state, cache, key, tokens, num_accepted, path, drafter, scores, nodes: int) -> DecodeState:
    """Appends the emitted tokens (accepted drafts + one target token), cut at a stop id or the row's limit."""
    B, T = tokens.shape
    n = state.length
    i = jnp.arange(T, dtype=jnp.int32)
    emitted = i[None, :] <= num_accepted[:, None]
    is_stop = (tokens[:, :, None] == state.stop_ids[:, None, :]).any(axis=2) & emitted
    stop_at = jnp.where(is_stop.any(axis=1), jnp.argmax(is_stop, axis=1), T)
    active = ~state.done
    count = jnp.minimum(jnp.minimum(num_accepted + 1, stop_at + 1), state.stop_len - n)
    count = jnp.where(active, count, 0)
    slots = jnp.where(i[None, :] < count[:, None], n[:, None] + i, state.tokens.shape[1])
    rows = jnp.arange(B)[:, None]
    new_tokens = state.tokens.at[rows, slots].set(tokens, mode="drop")
    length = n + count
    done = state.done | (active & ((stop_at < count) | (length >= state.stop_len)))

    stats = state.stats
    depth = stats.accepted_by_depth.shape[1]
    add = active.astype(jnp.int32)
    stats = SpecStats(
        iterations=stats.iterations + add,
        drafted=stats.drafted + add * nodes,
        accepted=stats.accepted + add * num_accepted,
        accepted_by_depth=stats.accepted_by_depth
        + (active[:, None] & (jnp.arange(depth)[None, :] < num_accepted[:, None])).astype(jnp.int32),
    )
    dstate = state.drafter
    if drafter is not None:
        budget = row_budget(drafter.spec, state.budget, stats, done)
        dstate = drafter.after_verify(dstate, budget, scores, cache, roots(n, done), num_accepted, path)
    return dataclasses.replace(
        state, tokens=new_tokens, length=length, done=done, cache=cache, drafter=dstate, key=key, stats=stats
    )
