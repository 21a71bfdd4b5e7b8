"""The scheduler: requests in, slots of one running decode state, tokens out as they are accepted.

A fixed number of slots (the batch rows of one static-shaped `engine.DecodeState`) run the engine's
loop in segments of a few iterations. Between segments the host, in one thread, frees the slots of
finished and cancelled requests (`engine.release`), admits waiting requests into free slots
(`engine.Engine.admit`: a jitted prefill of the new rows written into the running state) and hands each
running request the tokens its slot accepted during the segment. Serving segments are pipelined:
the programs that take the state run on a second thread, in the order queued (`_queue`), and the next
segment is queued before the host waits on the last one's report, so the device starts it as the last
one ends while the host hands out tokens; releases, admissions and a settled refinement's switches
then take effect one segment later (while the refinement is still deciding, each segment is timed
alone). A decode's call returns only once its loop has ended on the GPU (XLA reads a while loop's
condition on the host every iteration), and it releases the GIL. Every slot
follows its own request's sampling rules, seed, stop token ids and token limit (row rules: `sampling.RowSampling`);
stop strings are found on the host, which then frees the slot. Speculation runs per slot as in a
batch, with the server's one method. With `shrink`, the running rows move into a state of fewer rows
when most slots are free and nothing waits (an iteration of mostly finished rows costs nearly a full
one), and back to every slot when requests wait.

Requests come from other threads (the HTTP server's event loop): `submit` queues one (bounded:
beyond `queue_limit` it raises `QueueFull`), `Handle.cancel` asks for its slot back. A request's
listener is called from the scheduler thread with each `Delta`; the last one carries its
finish reason and statistics (the request types: `serving.requests`). The programs a scheduler
runs are compiled from `serving.programs`' table, by strategy and row count.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec import planner
from jaxspec.decoding import engine
from jaxspec.decoding.sampling import RowSampling, SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.decoding.tree import MAX_TREE_ROWS
from jaxspec.models import kvcache
from jaxspec.serving import programs
from jaxspec.serving.metrics import Metrics
from jaxspec.serving.pages import PagePool
from jaxspec.serving.requests import Delta, Handle, QueueFull, Request, RequestStats
from jaxspec.serving.text import TextStream
from jaxspec.tokenizer import Tokenizer
from pallas_kernels._common import next_pow2

log = logging.getLogger("jaxspec.serving")

MAX_STOP_TOKEN_IDS = 8  # stop token ids a request may add to the model's end-of-sequence ids
MIN_PROMPT_BUCKET = 64  # prompts are padded to powers of two from here (one admit program per bucket)
SHRINK_FACTOR = 4  # with `shrink`, the state shrinks once at most 1 / SHRINK_FACTOR of its rows run
LOAD_CALLS = 2  # a program's first calls, of no iterations (`_load`): XLA runs a command buffer once, then records it
_STATE = object()  # in `_queue`'s arguments: the state that the work queued before leaves


class Scheduler:
    """Runs one model, one method (or a plan, refined) and `slots` rows; see the module docstring."""

    def __init__(self, params, cfg, tokenizer: Tokenizer | None, spec: SpecConfig, *, slots: int, max_len: int,
                 stop_ids: tuple[int, ...] | None = None, sampling: SamplingConfig | None = None,
                 plan: planner.Plan | None = None, queue_limit: int = 256, segment: int | None = 2,
                 admit_rows: int | None = 1, static: bool = False, prefill_chunk: int | None = None,
                 max_top_k: int = 64, mesh: Mesh | None = None, shrink: bool = False, kv_pages: int | None = None,
                 page_size: int = kvcache.DEFAULT_PAGE_SIZE, prefix_cache: bool = True):
        """`tokenizer` None: token ids only (no text, no stop strings). `stop_ids`: ids that end every
        request (default: the tokenizer's end-of-sequence ids, if any). `sampling`: the one config every
        request uses, or None: each request's own (top_k up to `max_top_k`). `plan`: decode with its
        first strategy and refine it (`spec` is the base its strategies are applied to). `segment`:
        iterations per segment (None: until every slot is done). `admit_rows`: the most requests one
        admission prefills (None: every free slot). `static`: static batching, the baseline that
        continuous batching is measured against: requests are admitted only when every slot is
        free, all that wait (up to `slots`) in one prefill, and the batch holds its slots until its
        longest request ends. `prefill_chunk`: chunked prefill; an admission whose prompts are longer
        is prefilled this many positions per round, each round followed by a decode segment of the
        running slots, so a long prompt stalls them a chunk at a time (None: whole prompts). `mesh`:
        run tensor-parallel over it (`params` split by `models.sharding.shard_params`). `shrink`: once
        at most a quarter of the state's rows run and no request waits, the running rows move into a
        state of fewer rows (the next power of two; `engine.take_rows`), since an iteration whose rows
        are mostly finished still costs most of a full one; a waiting request grows it back to
        `slots` rows. Each row count compiles its own programs, on first use or in `warm_up`.

        The KV cache is a pool of pages (`models.kvcache`). `kv_pages` None: `slots` rows' worth, each
        admitted request taking a whole row of pages (a batch's cache). Given: a pool of that many pages
        of `page_size` slots (the null page included) shared by the slots; a request takes pages for its
        prompt, grows a page at a time before each segment, and when the pool runs out the most
        recently admitted request is preempted (its pages freed; it waits again, to be prefilled with
        the tokens it has so far and continue). With `prefix_cache`, full prompt pages stay cached
        and a later prompt with the same prefix reads them instead of prefilling them (not with an
        EAGLE-3 head, whose KV at a position depends on the next token)."""
        if slots < 1:
            raise JaxspecError(f"--slots must be at least 1, got {slots}")
        try:
            kvcache.paging.check_page_size(page_size, cfg.nsa.block_size if cfg.nsa else None)
        except ValueError as e:
            raise JaxspecError(f"--page-size: {e}") from None
        self.page_size = page_size
        self.row_pages = row_pages(max_len, page_size)
        self.paged = kv_pages is not None
        num_pages = kv_pages if self.paged else slots * self.row_pages + 1
        if num_pages - 1 < self.row_pages:  # so every request `check` lets in fits the pool alone
            raise JaxspecError(f"--kv-pages {num_pages} holds fewer than one request of --max-len {max_len} "
                               f"({self.row_pages} pages of {page_size} slots and the null page)")
        self.pool = PagePool(num_pages, page_size, prefix_cache and self.paged and spec.eagle is None)
        self.params, self.cfg, self.tokenizer, self.base = params, cfg, tokenizer, spec.validate()
        self.refinement = planner.Refinement.of(plan, closed=static) if plan else None
        self.spec = plan.first.spec(self.base) if plan else self.base  # the strategy running now
        self.slots, self.max_len, self.queue_limit, self.segment = slots, max_len, queue_limit, segment
        self.admit_rows = slots if static or admit_rows is None else admit_rows
        self.static, self.sampling, self.max_top_k, self.prefill_chunk = static, sampling, max_top_k, prefill_chunk
        self.mesh, self.shrink = mesh, shrink
        self.rows = slots  # rows of the running state: `slots`, or fewer after shrinking
        self.stop_ids = tuple(stop_ids if stop_ids is not None else tokenizer.eos_token_ids if tokenizer else ())
        self.stop_width = len(self.stop_ids) + MAX_STOP_TOKEN_IDS
        depth = max(c.strategy.spec(self.base).draft_len for c in plan.candidates) if plan else self.spec.draft_len
        self.metrics = Metrics(depth=depth)
        self.metrics.pool = self.pool
        self.compile_s = 0.0  # spent compiling programs (each shape once a process, on first use)
        self.load_s = 0.0  # spent on programs' first calls, of no iterations (`_load`)
        self._executables: dict = {}  # this scheduler's, by (program, shape): no signature to form per call
        self._lock = threading.Condition()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._cancelled: set[Handle] = set()
        self._running: dict[int, Handle] = {}
        self._staged: _Staged | None = None  # an admission being prefilled a chunk per round
        self._pages: dict[Handle, list[int]] = {}  # each admitted (or staged) request's pages, in order
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._dispatcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxspec-decode")  # `_queue`
        self._value: engine.DecodeState | None = None  # the state (`_state`), made by the first admission
        self._queued: concurrent.futures.Future | None = None  # the last work queued on the state (`_queue`)
        self._last = None  # (length, stats) host copies at the latest report, for refinement
        self._last_at = 0.0  # when the latest report arrived
        self._pending: _Segment | None = None  # a segment queued whose report the host has not read
        self._watch_from = None  # (report, start time) where a settled refinement's watch window began

    # --- called from any thread ---------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def _state(self) -> engine.DecodeState | None:
        """The state as the work queued on it leaves it (waits for that work)."""
        if self._queued is not None:
            self._value, self._queued = self._queued.result()[0], None
        return self._value

    @_state.setter
    def _state(self, state: engine.DecodeState | None) -> None:
        self._value, self._queued = state, None

    def check(self, request: Request) -> None:
        """Raises JaxspecError (HTTP 400) for a request this scheduler cannot run."""
        n = len(request.ids)
        if n == 0:
            raise JaxspecError("the prompt is empty")
        if n + 1 > self.max_len:
            raise JaxspecError(f"the prompt has {n} tokens; this server's context is {self.max_len} tokens, "
                               "and one must be left to generate")
        if request.max_new_tokens < 1:
            raise JaxspecError(f"max_tokens must be at least 1, got {request.max_new_tokens}")
        if n + request.max_new_tokens > self.max_len:
            raise JaxspecError(f"the prompt ({n} tokens) plus max_tokens ({request.max_new_tokens}) is more than "
                               f"this server's context of {self.max_len} tokens")
        if self.sampling is not None and request.sampling != self.sampling:
            raise JaxspecError(f"this scheduler samples every request with {self.sampling}, not {request.sampling}")
        if self.sampling is None and request.sampling.top_k > self.max_top_k:
            raise JaxspecError(f"top_k {request.sampling.top_k} is above this server's maximum of {self.max_top_k}")
        if len(request.stop_ids) > MAX_STOP_TOKEN_IDS:
            raise JaxspecError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(request.stop_ids)}")
        if request.stop and self.tokenizer is None:
            raise JaxspecError("stop strings need a tokenizer")
        vocab = self.cfg.vocab_size
        bad = [t for t in (*request.ids, *request.stop_ids) if not 0 <= t < vocab]
        if bad:
            raise JaxspecError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def submit(self, request: Request, listener: Callable[[Delta], None]) -> Handle:
        """Queues a checked request; raises QueueFull when more than `queue_limit` would wait beyond
        the free slots, JaxspecError when stopping or when the request cannot run."""
        self.check(request)
        handle = Handle(self._cancel, request, listener)
        with self._lock:
            if self._stopping:
                raise JaxspecError("the server is shutting down")
            if len(self._waiting) >= self.queue_limit + self.slots - len(self._running):  # the free slots wait here too
                self.metrics.count_request("rejected")
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue holds {self.queue_limit})")
            self._waiting.append(handle)
            self.metrics.set_queue(len(self._waiting), len(self._running))
            self._lock.notify()
        return handle

    def _cancel(self, handle: Handle) -> None:
        with self._lock:
            if handle in self._waiting:
                self._waiting.remove(handle)
                self._finish(handle, "cancelled")
            else:  # running, or being admitted: its slot is freed once it runs (`_release_cancelled`)
                self._cancelled.add(handle)
            self._lock.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jaxspec-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Drains: no new requests; the waiting and running ones finish; then the thread ends."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self._dispatcher.shutdown()

    def warm_up(self, prompt_tokens: int = MIN_PROMPT_BUCKET) -> None:
        """Compiles the empty state, the segment, the admissions of prompts of up to `prompt_tokens`
        tokens (every prompt bucket and group size up to `admit_rows`), the refinement's replays, and
        with `shrink` what shrinking runs (nothing decodes), so the first requests don't wait on it; then
        makes the segment's first calls (`load`), so their first segment doesn't either."""
        if self._state is None:
            self._state = self._free_state()
        for width in self._buckets(prompt_tokens):
            chunked = self.prefill_chunk is not None and width > self.prefill_chunk
            for n in sorted({self._row_bucket(k) for k in range(1, self.admit_rows + 1)}):
                args = self._admission([], [], n, width)
                if chunked:
                    self._executable(self._programs().chunk, self.params, self._state, args.pages, args.begin,
                                     args.prompts, args.lengths, shape=(n, width))
                admit = self._programs().admit_prefilled if chunked else self._programs().admit
                self._executable(admit, self.params, self._state, *args, shape=(n, width, chunked))
        self._compile_segment(self._state, self.slots)
        if self.refinement is not None and self.refinement.replayed:  # the replays of its first segments
            length, ran = jax.device_get((self._state.length, self._state.stats.iterations))
            self._executable(self._replays_program(), self._state, length, ran, shape=self._state.tokens.shape)
        if self.shrink:
            self._warm_up_shrinking()
        self.load()

    def load(self) -> None:
        """Calls the program the next segment runs with no iterations unless this process has (`_load`):
        one-time costs a run's decode time should not hold. The programs the run calls later (release;
        report, outside a watch) are compiled first, since XLA drops every other executable's command
        buffers whenever it loads a new one."""
        if self.refinement is not None and self.refinement.watches_on_device and self.segment is None:
            self._executable(self._programs().release, self._state, np.zeros((self.rows,), bool))
            program, args = self._watched_call()
            self._load(program, lambda: args(0, 0), shape=(self.rows,), first=0)
        else:
            self._compile_segment(self._state, self.rows)
            self._load(self._programs().decode, self._empty_segment, first=0)

    def _empty_segment(self) -> tuple:
        """The decode program's arguments for a segment of no iterations on the running state."""
        return self.params, self._state, np.int32(0), np.int32(0), np.zeros((self.rows,), np.int32)

    def _compile_segment(self, state: engine.DecodeState, rows: int) -> None:
        """Compiles a segment's programs (decode, release, report) for `state` of `rows` rows."""
        table, since = self._programs(rows), np.zeros((rows,), np.int32)
        self._executable(table.decode, self.params, state, np.int32(0), np.int32(0), since)
        self._executable(table.release, state, np.zeros((rows,), bool))
        self._executable(table.report, state, since)
        if self.paged:
            self._executable(table.grow, state, np.zeros((rows,), np.int32), np.zeros((rows, self.row_pages), np.int32))

    def _warm_up_shrinking(self, rows: int | None = None, state: engine.DecodeState | None = None,
                           warmed: set[int] | None = None) -> None:
        """Compiles, for every row count shrinking can reach from `rows` (default: every slot), its
        take from each larger count, its segment and its place back into every slot, for the smaller
        states' shapes (nothing runs); without the memory for a smaller state's rows beside the
        running one, shrinking is turned off."""
        rows, state = rows or self.slots, state if state is not None else self._state
        warmed = set() if warmed is None else warmed  # row counts whose programs are compiled
        for target in reversed(_shrink_targets(rows)):
            order = jnp.arange(target, dtype=jnp.int32)
            with _unusable_donations():
                take = self._executable(self._programs(rows).take, self.params, state, order, shape=(target,))
            if target in warmed:
                continue
            if not self._fits(take):
                return
            smaller = take.out_info
            self._compile_segment(smaller, target)
            with _unusable_donations():
                self._executable(self._programs(self.slots).place, self.params, smaller, self._all_rules(),
                                 self.spec.budget(), shape=(target,))
            warmed.add(target)
            self._warm_up_shrinking(target, smaller, warmed)
            if not self.shrink:  # a smaller count did not fit
                return

    # --- the scheduler thread (the server's) or the caller's (the runner's) ----------------------------

    @property
    def state(self) -> engine.DecodeState | None:
        """The running decode state (every slot's tokens, lengths and stats under the current strategy),
        once the work queued on it has run: read it on the scheduler's thread only, which queues that work."""
        return self._state

    def step(self) -> None:
        """One round: frees cancelled slots, admits waiting requests, runs a segment. Raises on failure."""
        self._release_cancelled()
        self.admit_waiting()
        if self._running:
            self.run_segment()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._running or self._staged or self._stopping):
                    self._lock.wait()
                if self._stopping and not (self._waiting or self._running or self._staged):
                    return
            try:
                self._release_cancelled()
                self.admit_waiting()
            except Exception as e:  # the admitted requests failed; the others go on unless the state is lost
                log.exception("admission failed")
                if self._lost():
                    self._fail_all(f"internal error: {type(e).__name__}: {e}")
                continue
            try:
                if self._running:
                    self.run_segment()
            except Exception as e:  # a device or program failure: fail what runs, keep serving
                log.exception("scheduler step failed")
                self._fail_all(f"internal error: {type(e).__name__}: {e}")

    def admit_waiting(self, cache=None) -> None:
        """Admits waiting requests into free slots, `admit_rows` per prefill, and hands each its first
        token. `cache` (a `runner.prefill_fn` output, donated) holds the prompts' KV when the waiting
        requests fill every slot of a fresh scheduler (the runner's batch): it replaces their prefill.
        If an admission fails, its requests fail and the error is raised. With chunked prefill, an
        admission of long prompts is staged: one chunk per call, admitted after its last chunk;
        nothing else is admitted meanwhile."""
        start = time.perf_counter()
        if self._staged is not None:
            if self._guarded(self._staged.group, self._prefill_next_chunk):
                self._deliver(start)
            return
        if self.static and self._running:
            return
        if self._waiting and self.rows < self.slots:
            self._grow()
        free = [s for s in range(self.slots) if s not in self._running]
        if free and self._waiting and self._queued is not None:
            self._queued.result()  # a failure of the work queued so far is the running requests', raised here
        admitted = 0
        try:
            while free:
                with self._lock:
                    group = []  # the longest run of waiting requests, in order, whose pages the pool has now
                    most = min(len(free), self.admit_rows)
                    while self._waiting and len(group) < most and self._take_pages(self._waiting[0]):
                        group.append(self._waiting.popleft())
                    self.metrics.set_queue(len(self._waiting), len(self._running))
                if not group:
                    break
                slots, free = free[: len(group)], free[len(group) :]
                width = self._bucket(max(len(self._prompt(h)) for h in group))
                if cache is None and self.prefill_chunk is not None and width > self.prefill_chunk:
                    admitted += len(group) if self._guarded(group, lambda: self._stage(group, slots)) else 0
                    break
                self._guarded(group, lambda: self._admit(group, slots, cache))
                admitted += len(group)
        except Exception:  # what was admitted gets its first token when a later group fails (the report
            if admitted and not self._lost():  # of a segment queued ahead is of the rows before them)
                self._deliver(start)
            raise
        if admitted:
            self._deliver(start)

    def _prompt(self, h: Handle) -> tuple[int, ...]:
        """What a request's admission prefills: its prompt and, after a preemption, the tokens it has."""
        return (*h.request.ids, *h.tokens)

    def _stop_ids(self, r: Request) -> tuple[int, ...]:
        """The token ids that end a request: the model's own (unless it ignores them) and its own."""
        return (*(() if r.ignore_eos else self.stop_ids), *r.stop_ids)

    def _row_need(self, tokens: int) -> int:
        """Pages of a row holding `tokens` positions (at most max_len) and a draft tree beyond them."""
        return min(self.pool.pages_for(min(tokens, self.max_len) + MAX_TREE_ROWS), self.row_pages)

    def _horizon(self) -> int:
        """Positions a row may write beyond what the host has handed out: the segment in flight and the
        next one (the host knows lengths only up to the last report)."""
        return self._window() + 1

    def _wants(self, h: Handle) -> int:
        """The pages `h`'s row needs before the next segment."""
        known, limit = len(h.request.ids) + h.read, len(h.request.ids) + h.request.max_new_tokens
        return self._row_need(min(known + self._horizon(), limit))

    def _growing(self) -> int:
        """Rows holding pages (running, staged or being admitted) that do not yet cover their whole
        output: admission leaves each of them a page to grow into (a projection at Qwen3-8B shapes: a
        third of the preemptions, as many requests held; bench/paged_capacity.py)."""
        limit = lambda h: self._row_need(len(h.request.ids) + h.request.max_new_tokens)
        return sum(len(pages) < limit(h) for h, pages in self._pages.items())

    def _take_pages(self, h: Handle) -> bool:
        """Gives `h` the pages of its prompt and its first segments (a whole row's without a page pool):
        the cached ones of its prefix, shared, and new ones for the rest; False, with nothing taken, if
        the pool lacks them or a page for each growing row besides (admitting it only to preempt it
        soon would prefill it for nothing)."""
        prompt = self._prompt(h)
        cached = self.pool.match(prompt)
        need = (self._wants(h) if self.paged else self.row_pages) - len(cached)
        new = self.pool.allocate(need) if self.pool.available >= need + (self._growing() if self.paged else 0) else None
        if new is None:
            self.pool.unmatch(prompt, cached)
            return False
        self._pages[h] = cached + new
        if not h.tokens:  # its prompt's cached tokens (a preempted request's prefix cache hits are its own)
            h.cached_tokens = len(cached) * self.page_size
        return True

    def _drop_pages(self, h: Handle) -> None:
        pages = self._pages.pop(h, None)
        if pages:
            self.pool.release(pages)

    def _guarded(self, group: list[Handle], work: Callable[[], bool | None]):
        """work(), whose failure fails the requests of `group` (and is raised)."""
        try:
            return work()
        except Exception as e:
            self._staged = None
            for h in group:
                self._finish(h, "error", error=f"{type(e).__name__}: {e}")
            raise

    def _stage(self, group: list[Handle], slots: list[int]) -> bool:
        """Starts the chunked prefill of `group` into `slots` (reserved: a cancel is kept until the
        request runs) and writes its first chunk into the state's pool; whether that admitted it (a
        one-chunk prompt)."""
        n, width = self._row_bucket(len(group)), self._bucket(max(len(self._prompt(h)) for h in group))
        args = self._admission(group, slots, n, width)
        if self._state is None:
            self._state = self._free_state()
        now = time.perf_counter()
        for h, slot in zip(group, slots):
            h.slot, h.admitted = slot, now
        rest = max(len(self._prompt(h)) - 1 - h.cached_tokens for h in group)
        self._staged = _Staged(group, slots, args, 0, rest)
        return self._prefill_next_chunk()

    def _prefill_next_chunk(self) -> bool:
        """Writes the staged admission's next chunk; after its last, admits it. Whether it did."""
        st = self._staged
        self._queue(self._programs().chunk, self.params, _STATE, st.args.pages, st.args.begin + np.int32(st.offset),
                    st.args.prompts, st.args.lengths, shape=st.args.prompts.shape)
        st.offset += self.prefill_chunk
        if st.offset < st.end:
            return False
        self._staged = None
        self._admit(st.group, st.slots, args=st.args)
        return True

    def _admit(self, group: list[Handle], slots: list[int], cache=None, args: _Admission | None = None) -> None:
        """Prefills `group` (or starts it from `cache`, its prompts' KV, or from a staged admission's
        `args`, whose prompts' KV the pool holds) into `slots`."""
        n, width = self._row_bucket(len(group)), self._bucket(max(len(self._prompt(h)) for h in group))
        prefilled = args is not None
        args = args or self._admission(group, slots, n, width)
        whole = self._state is None and n == self.slots and not self.paged and self.page_size == kvcache.DEFAULT_PAGE_SIZE
        if cache is not None and not whole:
            raise ValueError("a prefilled cache starts a fresh scheduler's every slot at once")
        if whole:  # every slot at once: the prefill is the state
            rows = args[3:]  # every argument but the slots and the page tables (each row's own consecutive pages)
            table = self._programs()
            program, inputs = (table.start, (cache, *rows)) if cache is not None else (table.prefill, rows)
            self._state = self._call(program, self.params, *inputs, self.spec.budget(), shape=(width,))
        else:
            if self._state is None:
                self._state = self._free_state()
            admit = self._programs().admit_prefilled if prefilled else self._programs().admit
            self._state = self._call(admit, self.params, self._state, *args, shape=(n, width, prefilled))
        now, self._watch_from = time.perf_counter(), None  # admitted rows restart their stats: a watch window starts after them
        for h, slot in zip(group, slots):
            self.pool.register(self._prompt(h), self._pages[h])  # its prompt's full pages, written now
            h.slot, h.admitted = slot, now
            if h.text is None and self.tokenizer:  # a preempted request keeps its text
                h.text = TextStream(self.tokenizer, h.request.stop)
            self._running[slot] = h
        self.metrics.set_queue(len(self._waiting), len(self._running))

    def _admission(self, group: list[Handle], slots: list[int], n: int, width: int) -> _Admission:
        """admit's arguments after the state for `group` padded to n rows (padding rows go to slot
        `self.rows`, which is out of range: their writes are dropped)."""
        ids = np.zeros((n, width), np.int32)
        lengths, seeds, limits = np.ones((n,), np.int32), np.zeros((n,), np.uint32), np.ones((n,), np.int32)
        stop = np.full((n, self.stop_width), -1, np.int32)
        where = np.full((n,), self.rows, np.int32)
        where[: len(slots)] = slots
        pages, begin = np.zeros((n, self.row_pages), np.int32), np.zeros((n,), np.int32)  # padding rows: the null page
        configs = [SamplingConfig() if self.sampling is None else self.sampling] * n
        for i, h in enumerate(group):
            r, prompt = h.request, self._prompt(h)
            ids[i, : len(prompt)], lengths[i], limits[i] = prompt, len(prompt), r.max_new_tokens - len(h.tokens)
            pages[i, : len(self._pages[h])], begin[i] = self._pages[h], h.cached_tokens
            seeds[i] = secrets.randbits(32) if r.seed is None else r.seed % (1 << 32)
            stop_ids = self._stop_ids(r)
            stop[i, : len(stop_ids)] = stop_ids
            configs[i] = r.sampling
        return _Admission(jnp.asarray(where), jnp.asarray(pages), jnp.asarray(begin), jnp.asarray(ids),
                          jnp.asarray(lengths), jnp.asarray(seeds), jnp.asarray(limits), jnp.asarray(stop),
                          self._rules(configs))

    def run_segment(self) -> None:
        """Decodes a segment (`segment` iterations; planner.SEGMENT while refining; while a closed batch
        watches on the host, its window, in segments of planner.AHEAD: the next segment runs ahead of each report,
        so a switch decided at a window's end lands at most AHEAD iterations late), hands out its
        tokens, and lets the refinement switch strategy. Serving's segments and a watch's are queued
        one ahead: the next is queued before the host waits on this one's report."""
        if self.refinement is not None and self.refinement.watches_on_device and self.segment is None:
            return self._run_watched()
        refining = self.refinement is not None and self.refinement.active
        watching = self.refinement is not None and self.refinement.watching
        iterations = (planner.SEGMENT if refining else min(self.refinement.window, planner.AHEAD)
                      if watching and self.segment is None else self.segment)
        unobserved = (refining or watching) and self.refinement.current not in self.refinement.observations
        if unobserved and self._watch_from is None:  # load its program unobserved (once a window: it may have begun)
            self._load(self._programs().decode, self._empty_segment, first=0)
        limit = np.int32(np.iinfo(np.int32).max if iterations is None else iterations)
        floor = np.int32(self._floor())
        before, (this, self._pending) = self._last, (self._pending, None)
        if this is None:
            self._reserve()
            this = self._segment(limit, floor)
        # a watch window starts at a report of the state's rows (not one read before a shrink or growth)
        if watching and self._watch_from is None and len(before[0]) == self.rows:
            self._watch_from = (before, this.start)
        # the replays of the window `this` may end, queued behind it: the device runs them as it ends, and
        # a window is judged only if they were queued (it cannot end unforeseen: `_ends_window`)
        ends = watching and self._watch_from is not None and self._ends_window(before, this)
        window = before if refining else self._watch_from[0] if ends else None
        replays = self._queue_replays(window) if window is not None else None
        ahead = None
        if (self.segment is not None or watching) and not refining and self._running:
            self._reserve()  # for this one and the next
            ahead = self._segment(limit, floor)
        seconds = self._deliver_segment(this, then=ahead)
        if ahead is not None:  # it began on the device as this one ended, when its report arrived
            self._pending = ahead._replace(start=self._last_at)
        target = None
        if refining:
            target = self.refinement.observe(planner.Observation.between(before, self._last, seconds), not self._running,
                                             self._replays(before, replays))
        elif ends and self._watched(self._last) >= self.refinement.window:
            (since, began), self._watch_from = self._watch_from, None
            seen = planner.Observation.between(since, self._last, self._last_at - began)  # to the report, not past it
            replayed = self._replays(since, replays)
            if self._pending is not None:  # queued behind the replays: it ran from their end (about their arrival)
                self._pending = self._pending._replace(start=time.perf_counter())
            target = self.refinement.watch(seen, not self._running, replayed, self._left())
        if target is not None:
            self._switch(target)
        self._shrink_if_few()

    def _segment(self, limit: np.int32, floor: np.int32) -> _Segment:
        """Queues a decode segment of at most `limit` iterations (ending once at most `floor` rows run),
        its report read from what the host has handed out so far."""
        since, started = self._since(), threading.Event()
        future = self._queue(self._programs().decode, self.params, _STATE, limit, floor, since, first=True,
                             started=started)
        return _Segment(future, since, time.perf_counter(), started, self.spec.whole_groups(int(limit)))

    def _ends_window(self, before, this: _Segment) -> bool:
        """Whether `this` segment, queued after the report `before`, may end the watch window: its rows
        run at most its iterations."""
        return self._watched(before) + this.iterations >= self.refinement.window

    def _watched(self, report) -> int:
        """Iterations the rows ran from the watch window's start to `report`: the most any row ran (a row
        freed before the window keeps its count, above the running rows', and would hide theirs in a
        difference of the maxima)."""
        return int((report[1].iterations - self._watch_from[0][1].iterations).max())

    def _queue_replays(self, since) -> concurrent.futures.Future | None:
        """The refinement's replays over the window from the report `since` to the end of the work
        queued so far, queued behind it (`programs.replays`), or None with nothing to replay."""
        if not self.refinement.replayed:
            return None
        return self._queue(self._replays_program(), _STATE, since[0], since[1].iterations,
                           shape=self._value.tokens.shape, keeps=True)

    def _run_watched(self) -> None:
        """`run_segment` for a closed batch settled on plain or on a model drafter observed or measured
        by a table (`planner.Refinement.watches_on_device`): one call of `programs.watched` decodes to the
        end of the run, unless a window's replay crosses its threshold or the drafter's own tokens per
        iteration fall under its look level (the host then judges the call and the device's replays of its
        last window, and decides as its own watch does) or the batch can shrink."""
        r = self.refinement
        program, args = self._watched_call()
        self._load(program, lambda: args(0, 0), shape=(self.rows,), first=0)
        before, start = self._last, time.perf_counter()
        floor = self._floor()
        self._reserve()
        call = args(np.iinfo(np.int32).max, floor)
        self._pending = None  # a segment queued ahead: this call's report reads its tokens too
        self._state, report, watch = self._call(program, *call, shape=(self.rows,))
        report, watch = jax.device_get((report, watch))  # both read at once, before a release is queued
        seconds = self._deliver(start, (call[-1], report))
        seen = planner.Observation.between(before, self._last, seconds)
        length, ran, window, crossed, replayed = programs.unpack_watch(watch)
        if not crossed:
            r.watched(seen, window)
        else:
            r.window = window // 2  # the window that crossed: `watch` doubles it, or starts again on a switch
            since = (length, dataclasses.replace(self._last[1], iterations=ran))
            target = r.watch(seen, not self._running, self._replays(since, replayed), self._left())
            if target is not None:
                self._switch(target)
        self._shrink_if_few()

    def _watched_call(self):
        """(`programs.watched` for the running strategy and the refinement's replays, args(iterations,
        floor): its arguments for a call of at most `iterations` iterations ending once at most `floor`
        rows run)."""
        r = self.refinement
        program = programs.watched(self.cfg, self.spec.compiled(self.max_len), self.sampling, self.max_len,
                                   tuple(s.spec(self.base) for s in r.replayed), self._window(), self.mesh)
        level = r.look_level(r.own_floor())
        thresholds = r.thresholds(level)
        thresholds = np.asarray([thresholds[s] for s in r.replayed], np.float32)
        level = np.float32(level)
        until = np.int32(r.watch_until(self._left()))

        def args(iterations: int, floor: int):
            window = np.int32(r.window)
            return (self.params, self._state, np.int32(iterations), np.int32(floor), window, thresholds, level, until,
                    self._since())

        return program, args

    def _floor(self) -> int:
        """A segment's `min_live`: it ends when at most this many rows run, the most that run when the
        batch shrinks (0: it does not shrink, or already runs no more)."""
        most = self.rows // SHRINK_FACTOR if self._may_shrink() else 0
        return most if len(self._running) > most else 0

    def _left(self) -> int | None:
        """The most tokens a running row of a static batch may still take (None in a server: its
        freed rows take new requests)."""
        if not self.static:
            return None
        return max((h.request.max_new_tokens - len(h.tokens) for h in self._running.values()), default=0)

    def _shrink_if_few(self) -> None:
        if self._may_shrink() and 0 < len(self._running) <= self.rows // SHRINK_FACTOR:
            self._flush()
            if self._running:
                self._shrink()

    def _reserve(self) -> None:
        """Gives each running row the pages the segment in flight and the next one may write (the host
        knows its length only up to the last report), earliest admitted first; while the pool lacks
        them, preempts the most recently admitted request."""
        if not self.paged:
            return
        grown = False
        for h in sorted(self._running.values(), key=lambda h: h.admitted):
            while self._running.get(h.slot) is h:
                need, have = self._wants(h), self._pages[h]
                if need <= len(have):
                    break
                new = self.pool.allocate(need - len(have))
                if new is not None:
                    have += new
                    grown = True
                    break
                self._preempt(max(self._running.values(), key=lambda h: h.admitted))
        if grown:
            table = np.zeros((self.rows, self.row_pages), np.int32)
            for slot, h in self._running.items():
                table[slot, : len(self._pages[h])] = self._pages[h]
            self._queue(self._programs().grow, _STATE, np.arange(self.rows, dtype=np.int32), table)

    def _preempt(self, h: Handle) -> None:
        """Frees `h`'s slot and pages and queues it first, to be prefilled again with the tokens it has
        been handed (recompute: what its slot drew since then is dropped, never handed out)."""
        if self._last is not None and self._last_at > h.admitted:  # its slot's stats so far
            h.before_switch = _add_row_stats(h.before_switch, _row_stats(self._last[1], h.slot))
        self._free([h.slot])
        del self._running[h.slot]
        self._drop_pages(h)
        h.slot = None
        with self._lock:
            if h in self._cancelled:  # its client is gone: it ends here
                self._cancelled.discard(h)
                self._finish(h, "cancelled")
            else:
                self._waiting.appendleft(h)
        self.metrics.count_preemption()
        log.info("preempted request %s after %d tokens: the KV pool is full", h.id, h.read)

    def _replays(self, since, replayed) -> dict:
        """{Strategy: Observation.replayed} of the refinement's replayed strategies over the tokens
        committed since the report `since` up to the latest one, by the rows that ran the whole window,
        from `replayed`, the device's replays of that window: their iterations [S, B] (`programs.watched`)
        or the future of `_queue_replays` (None: nothing to replay)."""
        if not self.refinement.replayed:
            return {}
        whole = planner.whole_rows(since, self._last)
        end = self._last[0]
        start = np.where(whole, since[0], end)
        if isinstance(replayed, concurrent.futures.Future):
            replayed = replayed.result()[1]
        replayed = np.asarray(jax.device_get(replayed))
        return {s: planner.Observation.replayed(end - start, iterations, whole)
                for s, iterations in zip(self.refinement.replayed, replayed)}

    def _replays_program(self) -> programs.Program:
        """`programs.replays` of the refinement's replayed strategies (compiled per tokens' shape: their
        width is the running strategy's depth)."""
        specs = tuple(s.spec(self.base) for s in self.refinement.replayed)
        return programs.replays(self.cfg, specs, self.max_len)

    def _may_shrink(self) -> bool:
        return (self.shrink and not self._waiting and self._staged is None
                and not (self.refinement is not None and self.refinement.active))

    def _shrink(self) -> None:
        """Moves the running rows, in slot order, into a state of the next power of two rows (padded
        with finished rows); their requests take the new row numbers. Turns `shrink` off when the
        device lacks the memory for both states at once."""
        running = sorted(self._running)
        rows = next_pow2(len(running))
        order = running + [s for s in range(self.rows) if s not in self._running][: rows - len(running)]
        order = jnp.asarray(order, jnp.int32)
        with _unusable_donations():
            take = self._executable(self._programs().take, self.params, self._state, order, shape=(rows,))
        if not self._fits(take):
            return
        self._state = take(self.params, self._state, order)
        self._last = jax.tree.map(lambda x: x[np.asarray(order)], self._last)  # the latest report, of the rows taken
        self._watch_from = None  # a watch window's rows are those of one state
        self._running = {row: self._running[slot] for row, slot in enumerate(running)}
        for row, h in self._running.items():
            h.slot = row
        self.rows = rows

    def _fits(self, take) -> bool:
        """Whether the device has free memory for `take`'s smaller state beside the running one (its
        rows: the KV pool moves over in place); if not, shrinking is turned off (with a warning)."""
        pools = {id(x) for x in jax.tree.leaves(take.out_info.cache) if x.ndim == 4}  # moved in place
        needed = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(take.out_info) if id(x) not in pools)
        memory = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in memory and memory["bytes_limit"] - memory["bytes_in_use"] < needed:
            log.warning("shrinking off: %.1f GiB free, a state of fewer rows needs %.1f GiB",
                        (memory["bytes_limit"] - memory["bytes_in_use"]) / 2**30, needed / 2**30)
            self.shrink = False
            return False
        return True

    def _grow(self) -> None:
        """Back to `slots` rows for waiting requests: the running rows keep their row numbers in a
        fresh state of free rows (with none running, the next admission makes the state)."""
        self._flush()
        if not self._running and not self.paged:
            self._state, self.rows, self._watch_from = None, self.slots, None
            self._new_pool()
            return
        with _unusable_donations():
            self._state = self._call(self._programs(self.slots).place, self.params, self._state, self._all_rules(),
                                     self.spec.budget(), shape=(self.rows,))
        self.rows, self._watch_from = self.slots, None

    def _switch(self, target: planner.Strategy) -> None:
        """Every slot continues under `target` (`engine.Engine.switch`: exact); the slots' stats so far move
        to their requests (the switch zeroes the state's)."""
        before = self._last
        seconds = self._flush()  # the segment queued ahead first: its tokens, its record, its stats the switch zeroes
        if seconds is not None:
            self.refinement.ran_ahead(planner.Observation.between(before, self._last, seconds))
        _, stats = self._last
        for slot, h in self._running.items():
            h.before_switch = _add_row_stats(h.before_switch, _row_stats(stats, slot))
        old = self.spec
        self.spec, self._watch_from = target.spec(self.base), None  # the switch zeroes the stats a window counts from
        start = time.perf_counter()
        with _unusable_donations():  # the old tokens buffer has the old width
            self._state = self._call(self._programs().switch, self.params, self._state, self.spec.budget(), shape=(old,))
        self._deliver(start)  # the switch's plain step drew a token per slot

    def _since(self) -> np.ndarray:
        """[rows] each running slot's position up to which its tokens are handed out."""
        since = np.zeros((self.rows,), np.int32)
        for slot, h in self._running.items():
            since[slot] = len(h.request.ids) + h.read
        return since

    def _report(self):
        """(since, the report program's output on the device, not yet read) for the running slots'
        tokens since the last delivery: all that the work queued so far commits, the segment queued
        ahead's included (its own report is not read)."""
        since, self._pending = self._since(), None
        return since, self._call(self._programs().report, self._state, since)

    def _deliver(self, start: float, report=None) -> float:
        """Hands each running request the tokens its slot committed since the last delivery (up to
        `report`, (since, the report): a segment's, default: all work queued so far) and finishes the
        requests that are done; returns the seconds since `start` (when the work that committed them
        began) to the tokens' arrival on the host."""
        since, report = report or self._report()
        finished, seconds = self._hand_out(start, since, report)
        self._free([h.slot for h in finished])  # those done on the device too: their tables leave their pages
        for h in finished:
            del self._running[h.slot]
        with self._lock:
            self.metrics.set_queue(len(self._waiting), len(self._running))
        return seconds

    def _deliver_segment(self, segment: _Segment, then: _Segment | None = None) -> float:
        """`_deliver` of a queued segment's report (waits for the segment to end). `then`: the segment
        queued behind it, whose call the hand-out waits for: the dispatch thread needs the GIL to make
        it, and the hand-out would hold it."""
        report = segment.future.result()[1][1]
        if then is not None:
            then.started.wait()
        return self._deliver(segment.start, (segment.since, report))

    def _flush(self) -> float | None:
        """Delivers the segment queued ahead, if any (before the rows change: its report is of the
        rows as they are); the seconds to its report, or None."""
        pending, self._pending = self._pending, None
        return None if pending is None else self._deliver_segment(pending)

    def _hand_out(self, start: float, since: np.ndarray, report) -> tuple[list[Handle], float]:
        """Reads `report` (tokens from `since`; the host may have handed out some of them since then)
        and hands each running request its tokens from where it is; returns the requests that finished
        and the seconds from `start` to the report's arrival."""
        length, done, window, stats = programs.unpack_report(jax.device_get(report))
        self._last = (length, stats)
        now = self._last_at = time.perf_counter()
        finished, new_tokens, seconds = [], 0, now - start
        for slot, h in list(self._running.items()):
            read = len(h.request.ids) + h.read
            count = int(length[slot] - read)
            tokens = window[slot, read - since[slot] : read - since[slot] + count].tolist()
            h.tokens += tokens
            new_tokens += count
            if count and h.first_token is None:
                h.first_token = now
            reason = None
            if done[slot]:
                ends = tokens and tokens[-1] in self._stop_ids(h.request)
                reason = "stop" if ends else "length"
                tokens = tokens[:-1] if ends else tokens
            text, stopped = h.text.push(tokens) if h.text else ("", False)
            if stopped:
                reason = "stop"
            if reason is None:
                if text or tokens:
                    _tell(h, Delta(text, tuple(tokens)))
                continue
            finished.append(h)
            text += h.text.flush() if h.text else ""
            self._finish(h, reason, text, tuple(tokens), row=_add_row_stats(h.before_switch, _row_stats(stats, slot)))
        self.metrics.add_segment(new_tokens, seconds)
        return finished, seconds

    def _release_cancelled(self) -> None:
        """Frees the slots of cancelled running requests (their clients are gone)."""
        with self._lock:  # a staged request's cancel waits until it runs
            handles = [h for h in self._cancelled if self._running.get(h.slot) is h]
            self._cancelled = {h for h in self._cancelled if self._staged and h in self._staged.group}
        if not handles:
            return
        self._free([h.slot for h in handles])
        for h in handles:
            self._running.pop(h.slot, None)
            self._finish(h, "cancelled")

    def _free(self, slots: list[int]) -> None:
        if slots:
            mask = np.zeros((self.rows,), bool)
            mask[slots] = True
            self._queue(self._programs().release, _STATE, mask)

    def _finish(self, h: Handle, reason: str, text: str = "", tokens: tuple[int, ...] = (), error: str | None = None,
                row: tuple = (0, 0, 0, ())) -> None:
        """Hands the request its last delta (its pages go back to the pool); `row`: its slot's
        (iterations, drafted, accepted, by depth)."""
        self._drop_pages(h)
        now = time.perf_counter()
        stats = RequestStats(
            prompt_tokens=len(h.request.ids), completion_tokens=len(h.text.ids) if h.text else h.read,
            cached_tokens=h.cached_tokens,
            iterations=row[0], drafted=row[1], accepted=row[2], accepted_by_depth=row[3],
            queued_s=(h.admitted or now) - h.submitted, first_token_s=(h.first_token or now) - h.submitted,
            total_s=now - h.submitted,
        )
        self.metrics.finish_request(reason, stats)
        _tell(h, Delta(text, tokens, reason, stats, error))

    def _fail_all(self, error: str) -> None:
        """Fails the running requests and starts again from free slots of `slots` rows (the state may be
        lost), once the work queued on the old state has ended (its buffers go before a new pool comes)."""
        handles = list(self._running.values()) + (self._staged.group if self._staged else [])
        if self._queued is not None:
            concurrent.futures.wait([self._queued])  # the dispatch thread runs its work in order: all of it
        self._running.clear()
        self._state, self._staged, self._pending = None, None, None
        self.rows, self._last, self._watch_from = self.slots, None, None
        for h in handles:
            self._finish(h, "error", error=error)
        self._new_pool()

    def _new_pool(self) -> None:
        """An empty page pool for a state made from nothing (cached prefixes included: their KV is gone)."""
        self.pool = self.metrics.pool = PagePool(self.pool.num_pages, self.page_size, self.pool.prefix_cache)

    def _lost(self) -> bool:
        """Whether the state's buffers are gone (donated to a program that failed)."""
        try:
            state = self._state
        except Exception:  # queued work on it failed
            return True
        return state is not None and any(x.is_deleted() for x in jax.tree.leaves(state))

    def _call(self, program: programs.Program, *args, shape: tuple = ()):
        """`program` on `args`. A segment's host values go in as numpy: a jnp scalar made here is
        an eager dispatch of its own on the scheduler thread (bench/NOTES.md, "where a 16-slot
        segment's time went")."""
        executable = self._executable(program, *args, shape=shape)
        programs.called(executable)
        return executable(*args)

    def _load(self, program: programs.Program, args: Callable[[], tuple], shape: tuple = (),
              first: int | None = None) -> None:
        """Calls `program` LOAD_CALLS times on args() (a segment of no iterations on the running state;
        its output's state, or its output's `first` item, is the new state) unless this process has called
        it before. A program's first call loads its kernels, and XLA runs each command buffer op by op at
        its first execution and records it at the next (`CommandBufferThunk`; those inside a loop's body
        only once the body runs): one-time costs that no observation of a strategy's rate, nor a run's
        decode time, should hold. The time goes to `load_s`."""
        if programs.ran(self._executable(program, *args(), shape=shape)):
            return
        start = time.perf_counter()
        for _ in range(LOAD_CALLS):
            out = self._call(program, *args(), shape=shape)
            self._state = out if first is None else out[first]
        jax.block_until_ready(self._state)
        self.load_s += time.perf_counter() - start

    def _queue(self, program: programs.Program, *args, shape: tuple = (), first: bool = False, keeps: bool = False,
               started: threading.Event | None = None) -> concurrent.futures.Future:
        """Queues `program` on `args` on the dispatch thread, behind the work queued before; `_STATE` in
        `args` stands for the state that work leaves, and the output (its `first` item; with `keeps`,
        none of it: the state stays) is the state from then on. Returns the future of (that state, the
        output). The device starts it as the work before it ends, with no host work between them; the
        host waits only where it reads the state. `started` is set as the dispatch thread takes it up."""
        if (program, shape) not in self._executables:  # compiled once, for the state as it will be
            self._executable(program, *(self._state if a is _STATE else a for a in args), shape=shape)
        executable = self._executables[program, shape]
        programs.called(executable)
        prior, state = self._queued, self._value

        def run():
            if started is not None:
                started.set()
            current = prior.result()[0] if prior is not None else state
            out = executable(*(current if a is _STATE else a for a in args))
            return current if keeps else out[0] if first else out, out

        self._queued = self._dispatcher.submit(run)
        return self._queued

    def _executable(self, program: programs.Program, *args, shape: tuple = ()):
        """`program` compiled ahead of time for `args` (once a process: `programs.Program.compile`),
        kept by (program, `shape`), what this scheduler's calls of it vary in; the time goes to
        `compile_s`."""
        key = (program, shape)
        if key not in self._executables:
            self._executables[key], seconds = program.compile(*args, before=self._settle)
            self.compile_s += seconds
        return self._executables[key]

    def _settle(self) -> None:
        """Waits for the work queued so far to run, before a compile: compiling beside it would hide
        that work's time in `compile_s`, which a run's decode seconds leave out (`runner`)."""
        if not self._lost():
            jax.block_until_ready(self._state)

    def _programs(self, rows: int | None = None) -> programs.Programs:
        """The programs of the current strategy for a state of `rows` rows (default: the running state's)."""
        return programs.table(self.cfg, self.spec.compiled(self.max_len), self.sampling, self.max_len, rows or self.rows,
                              self.stop_width, self._window(), self.prefill_chunk, self.pool.num_pages, self.page_size,
                              self.mesh)

    def _window(self) -> int:
        """Tokens a report reads per slot: what the two longest segments can commit (a segment's report
        reads from where the host was when it was queued, one segment ahead), plus the first token
        (a segment runs whole groups of `select_every` iterations)."""
        iterations = self.spec.whole_groups(max(self.segment or self.max_len, planner.SEGMENT if self.refinement else 0))
        return min(2 * iterations * (self.spec.draft_len + 1) + 1, self.max_len)

    def _bucket(self, n: int) -> int:
        return min(max(MIN_PROMPT_BUCKET, next_pow2(n)), self.max_len)

    def _buckets(self, prompt_tokens: int) -> list[int]:
        """Every prompt bucket of prompts of up to `prompt_tokens` tokens, smallest first."""
        top, widths = self._bucket(prompt_tokens), [self._bucket(1)]
        while widths[-1] < top:
            widths.append(self._bucket(2 * widths[-1]))
        return widths

    def _row_bucket(self, n: int) -> int:
        """Rows of an admission of n requests: a power of two below the slot count, or every slot.
        (An admission of as many rows as slots replaces the whole state: `engine.write_rows`.)"""
        if n == self.slots:
            return n
        rows = next_pow2(n)
        return rows if rows < self.slots else self.slots - 1

    def _free_state(self) -> engine.DecodeState:
        """A state of `slots` free rows under the current strategy."""
        return self._call(self._programs(self.slots).empty, self.params, self._all_rules(), self.spec.budget())

    def _all_rules(self) -> RowSampling | None:
        """Free rows' sampling rules for every slot."""
        return self._rules([SamplingConfig()] * self.slots)

    def _rules(self, configs: list[SamplingConfig]) -> RowSampling | None:
        return None if self.sampling is not None else RowSampling.of(configs, self.max_top_k)


def _tell(h: Handle, delta: Delta) -> None:
    """Hands `h`'s listener a delta; its failure (a vanished client) is not the scheduler's."""
    try:
        h.listener(delta)
    except Exception:
        log.exception("listener failed")


def row_pages(max_len: int, page_size: int) -> int:
    """Pages of a row's table: max_len positions and a draft tree beyond them."""
    return kvcache.cache_slots(max_len + MAX_TREE_ROWS, page_size) // page_size


@contextlib.contextmanager
def _unusable_donations():
    """Silences XLA's note on donated buffers it cannot reuse: a state donated to a program whose output
    differs in shape (another row count, the tokens' width of another strategy) lends only what fits,
    the KV pool above all."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        yield


def _shrink_targets(rows: int) -> list[int]:
    """The row counts a state of `rows` rows can shrink to: powers of two up to the next one above
    the most rows that may run when it shrinks."""
    most = rows // SHRINK_FACTOR
    return [1 << k for k in range(next_pow2(most).bit_length())] if most else []


def _row_stats(stats, slot: int) -> tuple:
    return (int(stats.iterations[slot]), int(stats.drafted[slot]), int(stats.accepted[slot]),
            tuple(int(x) for x in stats.accepted_by_depth[slot]))


def _add_row_stats(a: tuple, b: tuple) -> tuple:
    """Two (iterations, drafted, accepted, by depth) of one slot summed; by depth padded to the deeper."""
    depth = max(len(a[3]), len(b[3]))
    pad = lambda x: (*x, *(0,) * (depth - len(x)))
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], tuple(x + y for x, y in zip(pad(a[3]), pad(b[3]))))


class _Segment(NamedTuple):
    """A decode segment queued (`Scheduler._segment`): the future of (state, (state, report)), where
    its report reads from (each row's position handed out when it was queued), when it began, and
    whether the dispatch thread has taken it up."""

    future: concurrent.futures.Future
    since: np.ndarray
    start: float
    started: threading.Event  # set as the dispatch thread takes it up
    iterations: int  # the most it runs


class _Admission(NamedTuple):
    """The arguments of an admission after the state (in the admit program's order)."""

    slots: jax.Array  # [n] the slots the rows go to
    pages: jax.Array  # [n, R] their page tables (the null page past their pages)
    begin: jax.Array  # [n] the positions their cached prefixes cover
    prompts: jax.Array  # [n, width] right-padded
    lengths: jax.Array  # [n]
    seeds: jax.Array  # [n] uint32
    limits: jax.Array  # [n] max new tokens
    stop_ids: jax.Array  # [n, stop_width], -1 pads
    rules: RowSampling | None


@dataclasses.dataclass
class _Staged:
    """An admission under chunked prefill: its requests, slots, admit arguments, the next chunk's first
    position past each row's cached prefix, and the most positions a row has to write."""

    group: list[Handle]
    slots: list[int]
    args: _Admission
    offset: int
    end: int
