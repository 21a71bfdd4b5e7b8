"""The scheduler's compiled programs: one `Programs` table per model, strategy, sampling mode and
row count, each program an attribute (`table(...).decode`), compiled ahead of time per argument
signature.

Compiled programs are shared by every scheduler of the process (`_EXECUTABLES`, by program and
argument signature): a later generate call (or scheduler) of the same shapes neither compiles again
nor pays a program's first launch on the GPU inside its decode (bench/NOTES.md, "auto's fixed
cost"). `clear_executables` drops them (the tests do, with JAX's caches).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec.decoding import engine
from jaxspec.decoding.drafters import make_drafter
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.decoding.tree import MAX_TREE_ROWS
from jaxspec.models import sharding

_EXECUTABLES: dict = {}  # {(Program, argument signature): compiled executable}
_RAN: set = set()  # the executables called at least once in this process (their first call loads them on the device)


def clear_executables() -> None:
    _EXECUTABLES.clear()
    _RAN.clear()


def ran(executable) -> bool:
    """Whether this process has called `executable` (`called` marks it)."""
    return executable in _RAN


def called(executable) -> None:
    _RAN.add(executable)


class Program:
    """One jitted program (`jax.jit` or `models.sharding.Parallel`), compiled ahead of time once per
    argument signature and process. Its executables are called, or handed to another thread to call
    (a decode's call returns only once its loop has ended), with the arguments it was compiled for."""

    def __init__(self, name: str, jitted):
        self.name, self.jitted = name, jitted

    def __repr__(self) -> str:
        return f"Program({self.name})"

    def compile(self, *args, before: Callable[[], None] = lambda: None) -> tuple[Callable, float]:
        """The executable for `args`' signature and the seconds spent compiling it now (0 when
        this process compiled it before); `before` runs first when it must compile."""
        key = (self, _signature(args))
        if key in _EXECUTABLES:
            return _EXECUTABLES[key], 0.0
        before()
        start = time.perf_counter()
        _EXECUTABLES[key] = self.jitted.lower(*args).compile()
        return _EXECUTABLES[key], time.perf_counter() - start


def _signature(args) -> tuple:
    """What a compiled program is specific to besides its function: the arguments' tree, shapes,
    dtypes and placements."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((getattr(x, "shape", ()), getattr(x, "dtype", type(x)), getattr(x, "sharding", None)) for x in leaves)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The programs of one strategy and row count. Those that take the state (or the prefilled
    cache) donate it, so it is updated in place."""

    empty: Program  # (params, rules, budget) -> a state of free rows
    prefill: Program  # every row at once: the prefill is the state
    start: Program  # every row at once from their prompts' KV (`runner.prefill_fn`)
    admit: Program  # rows prefilled into chosen slots of the running state
    decode: Program  # a segment: (params, state, iterations, min_live, since) -> (state, its report from since)
    release: Program  # (state, free [rows] bool)
    report: Program  # what the host reads of a state, from since (`unpack_report`)
    switch: Program  # the running state under this table's strategy (`engine.Engine.switch`)
    take: Program  # a shrunk state of chosen rows (params, state, rows)
    place: Program  # a grown state: a shrunk one's rows first, free rows after (params, state, rules, budget)
    admit_prefilled: Program  # rows whose prompts' KV a chunked prefill wrote, into chosen slots
    chunk: Program  # one chunk of a chunked prefill, into the state's pool under the rows' tables
    grow: Program  # (state, rows [n], their new page tables [n, R])


@functools.lru_cache(maxsize=None)
def table(cfg, spec: SpecConfig, sampling: SamplingConfig | None, max_len: int, slots: int, stop_width: int,
          window: int, prefill_chunk: int | None, num_pages: int, page_size: int, mesh: Mesh | None = None) -> Programs:
    """The programs for one model, strategy (`SpecConfig.compiled`), sampling mode (None: each row's
    rules) and state of `slots` rows over a KV pool of `num_pages` pages of `page_size` slots;
    `window`: tokens a report reads per row. With a `mesh`, each runs tensor-parallel over it
    (`models.sharding.Parallel`)."""
    make = functools.partial(_functions, spec=spec, sampling=sampling, max_len=max_len, slots=slots,
                             stop_width=stop_width, window=window, prefill_chunk=prefill_chunk, num_pages=num_pages,
                             page_size=page_size)

    def program(name: str, donate: tuple[int, ...] = ()) -> Program:
        if mesh is None:
            return Program(name, jax.jit(make(cfg)[name], donate_argnums=donate))
        return Program(name, sharding.Parallel(lambda c: make(c)[name], cfg, mesh, donate))

    return Programs(
        empty=program("empty"),
        prefill=program("prefill"),
        start=program("start", (1,)),
        admit=program("admit", (1,)),
        decode=program("decode", (1,)),
        release=program("release", (0,)),
        report=program("report"),
        switch=program("switch", (1,)),
        take=program("take", (1,)),  # donated, as place: the pool moves between states in place
        place=program("place", (1,)),
        admit_prefilled=program("admit_prefilled", (1,)),
        chunk=program("chunk", (1,)),
        grow=program("grow", (0,)),
    )


@functools.lru_cache(maxsize=None)
def replays(cfg, specs: tuple[SpecConfig, ...], max_len: int) -> Program:
    """The refinement's replays of the strategies not running (`Ngram.replay` of each of `specs`) over
    the window that ends at a state: (state, the window's start lengths [B], the rows' iterations
    there [B]) -> iterations [S, B] (`window_replays`). Queued behind a window's last segment, they
    run on the device as it ends, and the host reads them with its report."""
    drafters = [make_drafter(s, cfg, max_len) for s in specs]
    return Program("replays", jax.jit(lambda state, length, ran: window_replays(drafters, state, length, ran)))


def window_replays(drafters, state, length, ran):
    """Each drafter's `replay` [S, B] over the rows of `state` that ran every iteration since lengths
    `length` and row iterations `ran` [B] (the others replay nothing): the window ends at the state.
    [0, B] with no drafters (a running drafter watched with no ngram candidate)."""
    if not drafters:
        return jnp.zeros((0, *length.shape), jnp.int32)
    start = window_start(state, length, ran)[1]
    return jnp.stack([d.replay(state.tokens, start, state.length) for d in drafters])


def window_start(state, length, ran):
    """(the rows of `state` that ran every iteration since lengths `length` and row iterations `ran`
    [B], where each row's window starts: `length` for those rows, the state's length for the others)."""
    rows = state.stats.iterations - ran
    whole = rows == rows.max()
    return whole, jnp.where(whole, length, state.length)


def state_report(state, since, window: int):
    """What the host reads of a state, as one int32 array (one copy, not seven: `unpack_report`): per
    slot its length, done, stats and `window` tokens from `since`."""
    cols = since[:, None] + jnp.arange(window, dtype=jnp.int32)
    tokens = jnp.take_along_axis(state.tokens, jnp.minimum(cols, state.tokens.shape[1] - 1), axis=1)
    s = state.stats
    depth = jnp.full_like(state.length, s.accepted_by_depth.shape[1])
    head = jnp.stack([state.length, state.done, s.iterations, s.drafted, s.accepted, depth], axis=1)
    return jnp.concatenate([x.astype(jnp.int32) for x in (head, tokens, s.accepted_by_depth)], axis=1)


def unpack_report(packed: np.ndarray) -> tuple:
    """The report program's array as (length, done, tokens [rows, window], engine.SpecStats)."""
    depth = int(packed[0, 5])
    stats = engine.SpecStats(packed[:, 2], packed[:, 3], packed[:, 4], packed[:, packed.shape[1] - depth :])
    return packed[:, 0], packed[:, 1].astype(bool), packed[:, 6 : packed.shape[1] - depth], stats


@functools.lru_cache(maxsize=None)
def watched(cfg, spec: SpecConfig, sampling: SamplingConfig | None, max_len: int, replayed: tuple[SpecConfig, ...],
            tokens_read: int, mesh: Mesh | None = None) -> Program:
    """A closed batch's decode that watches on the device (`planner.Refinement.thresholds` and
    `look_level`): (params, state, iterations, min_live, window, thresholds [S], level, until, since) ->
    (state, its report from since (`state_report` of `tokens_read` tokens a row, as `decode`'s), what the
    watch saw (`unpack_watch`: the last window's start lengths [B] and row iterations [B], the next
    window, crossed, each replay's iterations over the last window [S, B], as `Ngram.replay` gives
    them: the host's replays need not run again)), the host reading the two in one copy each and no
    report call of its own. It decodes windows of `window`, 2 `window`, ... iterations as `decode` does
    (up to `iterations`, or until at most `min_live` rows run), and after each replays each of
    `replayed` (`Ngram.replay`) over the rows that ran the whole window, as the host's watch does; it
    stops after the first window, ending within `until` iterations of the call's start, whose slowest
    such row's replayed tokens per iteration reaches that strategy's threshold, or after which the
    running strategy's own tokens per iteration since the call's start (the mean row's, as
    `planner.Observation.between` counts them) are under `level` (`crossed`). So a run whose text
    neither repeats nor leaves its drafter is one call, with no host work between windows
    (bench/NOTES.md, "the watch on the device")."""

    def make(c):
        eng, drafters = engine.Engine(c, spec, sampling, max_len), [make_drafter(r, c, max_len) for r in replayed]

        def run(params, state, iterations, min_live, window, thresholds, level, until, since):
            first = state.stats

            def cond(carry):
                state, i, _, _, _, crossed, _ = carry
                return ~crossed & (jnp.sum(~state.done) > min_live) & (i < iterations)

            def body(carry):
                state, i, window, _, _, _, _ = carry
                length, ran = state.length, state.stats.iterations
                state = eng.decode(params, state, max_iterations=jnp.minimum(window, iterations - i), min_live=min_live)
                whole, start = window_start(state, length, ran)
                tokens = (state.length - start).astype(jnp.float32)
                crossed, i = jnp.bool_(False), i + (state.stats.iterations - ran).max()
                replays = window_replays(drafters, state, length, ran)
                for replayed, threshold in zip(replays, thresholds):
                    counted = whole & (replayed > 0)
                    slowest = jnp.min(jnp.where(counted, tokens / jnp.maximum(replayed, 1), jnp.inf))
                    crossed |= counted.any() & (slowest >= threshold) & (i <= until)
                row_iterations = jnp.sum(state.stats.iterations - first.iterations)
                own = (jnp.sum(state.stats.accepted - first.accepted) + row_iterations) / jnp.maximum(row_iterations, 1)
                crossed |= (row_iterations > 0) & (own < level) & (i <= until)
                return state, i, 2 * window, length, ran, crossed, replays

            zeros = jnp.zeros_like(state.length)
            state, _, window, length, ran, crossed, replays = jax.lax.while_loop(
                cond, body, (state, jnp.int32(0), window, zeros, zeros, jnp.bool_(False),
                             jnp.zeros((len(drafters), *zeros.shape), jnp.int32)))
            seen = jnp.stack([length, ran, jnp.broadcast_to(window, length.shape),
                              jnp.broadcast_to(crossed, length.shape).astype(jnp.int32)])
            return state, state_report(state, since, tokens_read), jnp.concatenate([seen, replays])

        return run

    if mesh is None:
        return Program("watched", jax.jit(make(cfg), donate_argnums=(1,)))
    return Program("watched", sharding.Parallel(make, cfg, mesh, (1,)))


def unpack_watch(packed: np.ndarray) -> tuple:
    """`watched`'s third output as (the last window's start lengths [B], row iterations [B], the next
    window, crossed, each replay's iterations [S, B])."""
    return packed[0], packed[1], int(packed[2, 0]), bool(packed[3, 0]), packed[4:]


def _functions(cfg, *, spec, sampling, max_len, slots, stop_width, window, prefill_chunk, num_pages,
               page_size) -> dict[str, Callable]:
    """The programs' functions for the model `cfg` (or one shard's view of it)."""
    eng = engine.Engine(cfg, spec, sampling, max_len)
    keys = jax.vmap(jax.random.key)

    def free_rows(n, params, rules, budget, pool=None):
        """A state of n free (done) rows, every table row on the null page, over an empty pool or over
        `pool` (a running state's: the free rows write only into the null page); `rules` of n rows, or
        None."""
        if pool is None:
            pool = engine.init_cache(cfg, n, max_len + MAX_TREE_ROWS, spec.eagle, page_size, num_pages)
        else:
            pool = pool.with_pages(jnp.zeros((n, pool.pages.shape[1]), jnp.int32))
        state = eng.start(
            params, pool, jnp.zeros((n, 1), jnp.int32), jnp.ones((n,), jnp.int32), keys(jnp.zeros((n,), jnp.uint32)),
            budget, max_new_tokens=jnp.ones((n,), jnp.int32), stop_ids=-jnp.ones((n, stop_width), jnp.int32),
            row_sampling=rules)
        return engine.release(state, jnp.ones((n,), bool))

    empty = functools.partial(free_rows, slots)

    def prefill(params, prompts, prompt_len, seeds, max_new_tokens, stop_ids, rules, budget):
        return eng.prefill(params, prompts, prompt_len, keys(seeds), max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                           budget=budget, row_sampling=rules)

    def start(params, cache, prompts, prompt_len, seeds, max_new_tokens, stop_ids, rules, budget):
        return eng.start(params, cache, prompts, prompt_len, keys(seeds), budget, max_new_tokens=max_new_tokens,
                         stop_ids=stop_ids, row_sampling=rules)

    def admit(params, state, slots_, pages, begin, prompts, prompt_len, seeds, max_new_tokens, stop_ids, rules,
              prefilled=False):
        return eng.admit(params, state, slots_, prompts, prompt_len, keys(seeds), max_new_tokens, stop_ids, rules,
                         pages=pages, begin=begin, prefilled=prefilled)

    def chunk(params, state, pages, begin, prompts, prompt_len):
        """`state` with one chunk of the rows' prompts (from begin [n]) written into its pool under
        their tables `pages` [n, R]; the running rows' tables are untouched."""
        cache = engine.prefill_chunk(params, state.cache.with_pages(pages), prompts=prompts, prompt_len=prompt_len,
                                     begin=begin, cfg=cfg, backend=spec.backend, chunk=prefill_chunk, head=spec.eagle)
        return dataclasses.replace(state, cache=cache.with_pages(state.cache.pages))

    def grow(state, rows, pages):
        """`state` with the page tables of rows `rows` [n] replaced by pages [n, R] (a row given more
        pages before a segment; an index past the rows: dropped)."""
        return dataclasses.replace(state, cache=state.cache.with_pages(state.cache.pages.at[rows].set(pages, mode="drop")))

    report = functools.partial(state_report, window=window)

    def decode(params, state, iterations, min_live, since):
        """A segment and its report: a report of its own would be another call between segments,
        which takes ~0.6 ms of host time on an H200 (bench/NOTES.md, "segments queued ahead")."""
        state = eng.decode(params, state, max_iterations=iterations, min_live=min_live)
        return state, report(state, since)

    def switch(params, state, budget):
        return eng.switch(params, state, budget)

    def take(params, state, rows):
        """The state of rows `rows` [n] (n < slots), in that order: a shrunk batch."""
        rules = None if state.sampling is None else jax.tree.map(lambda x: x[rows], state.sampling)
        smaller = jax.eval_shape(functools.partial(free_rows, rows.shape[0]), params, rules, state.budget)
        return engine.take_rows(state, rows, smaller)

    def place(params, rows, rules, budget):
        """A state of `slots` rows whose first are the n rows of `rows`, the others free (`rules` of
        every slot): a grown batch, over `rows`' pool."""
        state = free_rows(slots, params, rules, budget, rows.cache)
        return engine.write_rows(state, rows, jnp.arange(rows.length.shape[0], dtype=jnp.int32))

    return dict(empty=empty, prefill=prefill, start=start, admit=admit, decode=decode, release=engine.release,
                report=report, switch=switch, admit_prefilled=functools.partial(admit, prefilled=True), chunk=chunk,
                grow=grow, take=take, place=place)
