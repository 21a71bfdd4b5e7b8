"""The scheduler: requests in, slots of one running decode state, tokens out as they are accepted.

A fixed number of slots (the batch rows of one static-shaped `engine.DecodeState`) run the engine's
loop in segments of a few iterations. Between segments the host, in one thread, frees the slots of
finished and cancelled requests (`engine.release`), admits waiting requests into free slots
(`engine.admit`: a jitted prefill of the new rows written into the running state) and hands each
running request the tokens its slot accepted during the segment. Every slot follows its own
request's sampling rules, seed, stop token ids and token limit (row rules: `sampling.RowSampling`);
stop strings are found on the host, which then frees the slot. Speculation runs per slot as in a
batch, with the server's one method.

Requests come from other threads (the HTTP server's event loop): `submit` queues one (bounded:
beyond `queue_limit` it raises `QueueFull`), `Handle.cancel` asks for its slot back. A request's
listener is called from the scheduler thread with each `Delta`; the last one carries its
finish reason and statistics.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import secrets
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import engine
from jaxspec.decoding.sampling import RowSampling, SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.serving.metrics import Metrics
from jaxspec.serving.text import TextStream
from jaxspec.tokenizer import Tokenizer

log = logging.getLogger("jaxspec.serving")

MAX_STOP_TOKEN_IDS = 8  # stop token ids a request may add to the model's end-of-sequence ids
MIN_PROMPT_BUCKET = 64  # prompts are padded to powers of two from here (one admit program per bucket)


class QueueFull(Exception):
    """More requests are waiting than the queue holds (HTTP 429)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: prompt token ids and how to continue them."""

    ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # stop strings (the text ends before the first one)
    stop_ids: tuple[int, ...] = ()  # token ids that end the request, besides the model's own


@dataclasses.dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    completion_tokens: int
    iterations: int  # decode iterations the request's slot ran (its first token came from prefill)
    drafted: int
    accepted: int
    accepted_by_depth: tuple[int, ...]
    queued_s: float  # submit to admission
    first_token_s: float  # submit to first token
    total_s: float


@dataclasses.dataclass(frozen=True)
class Delta:
    """What a request's listener receives: new text and tokens; `finish_reason` (stop, length,
    cancelled, error) and `stats` on the last one, `error` when it failed."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None


class Handle:
    """A submitted request: its id, and `cancel` (its slot is freed before the next segment)."""

    def __init__(self, scheduler: Scheduler, request: Request, listener: Callable[[Delta], None]):
        self.id = secrets.token_hex(8)
        self.request, self.listener, self._scheduler = request, listener, scheduler
        self.submitted = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.slot: int | None = None
        self.read = 0  # tokens of the slot already handed out (from the prompt's end)
        self.text: TextStream | None = None

    def cancel(self) -> None:
        self._scheduler._cancel(self)


class Scheduler:
    """Runs one model, one method and `slots` rows; see the module docstring."""

    def __init__(self, params, cfg, tokenizer: Tokenizer, spec: SpecConfig, *, slots: int, max_len: int,
                 queue_limit: int = 256, segment: int = 2, max_top_k: int = 64):
        if slots < 1:
            raise JaxspecError(f"--slots must be at least 1, got {slots}")
        self.params, self.cfg, self.tokenizer, self.spec = params, cfg, tokenizer, spec.validate()
        self.slots, self.max_len, self.queue_limit, self.segment, self.max_top_k = slots, max_len, queue_limit, segment, max_top_k
        self.stop_width = len(tokenizer.eos_token_ids) + MAX_STOP_TOKEN_IDS
        self.metrics = Metrics(depth=self.spec.draft_len)
        self._lock = threading.Condition()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._cancelled: set[Handle] = set()
        self._running: dict[int, Handle] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._fns = _programs(cfg, self.spec.compiled(max_len), max_len, slots, self.segment * (self.spec.draft_len + 1) + 1)
        self._state = self._fns.empty(params, self._row_rules([SamplingConfig()] * slots), self.spec.budget(), self.stop_width)

    # --- called from any thread ---------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def check(self, request: Request) -> None:
        """Raises JaxspecError (HTTP 400) for a request this server cannot run."""
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
        if request.sampling.top_k > self.max_top_k:
            raise JaxspecError(f"top_k {request.sampling.top_k} is above this server's maximum of {self.max_top_k}")
        if len(request.stop_ids) > MAX_STOP_TOKEN_IDS:
            raise JaxspecError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(request.stop_ids)}")
        vocab = self.cfg.vocab_size
        bad = [t for t in (*request.ids, *request.stop_ids) if not 0 <= t < vocab]
        if bad:
            raise JaxspecError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def submit(self, request: Request, listener: Callable[[Delta], None]) -> Handle:
        """Queues a checked request; raises QueueFull when more than `queue_limit` would wait beyond
        the free slots, JaxspecError when stopping or when the request cannot run."""
        self.check(request)
        handle = Handle(self, request, listener)
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
            elif handle.slot is not None:
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

    def warm_up(self, prompt_tokens: int = MIN_PROMPT_BUCKET) -> None:
        """Compiles the segment and the admission of a prompt of up to `prompt_tokens` tokens (an
        idle slot runs them; the state is unchanged), so the first requests don't wait on it."""
        bucket = self._bucket(prompt_tokens)
        self._state = self._fns.admit(
            self.params, self._state, jnp.zeros((1,), jnp.int32), jnp.zeros((1, bucket), jnp.int32), jnp.ones((1,), jnp.int32),
            jnp.zeros((1,), jnp.uint32), jnp.ones((1,), jnp.int32), -jnp.ones((1, self.stop_width), jnp.int32),
            self._row_rules([SamplingConfig()]))
        self._state = self._fns.release(self._state, jnp.ones((self.slots,), bool))
        self._state = self._fns.decode(self.params, self._state, jnp.int32(self.segment))
        jax.block_until_ready(self._fns.report(self._state, jnp.zeros((self.slots,), jnp.int32)))

    # --- the scheduler thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._running or self._stopping):
                    self._lock.wait()
                if self._stopping and not (self._waiting or self._running):
                    return
                cancelled, self._cancelled = self._cancelled, set()
            try:
                self._release([h for h in cancelled if h.slot is not None], "cancelled")
                self._admit_waiting()
                if self._running:
                    self._run_segment()
            except Exception as e:  # a device or program failure: fail what runs, keep serving
                log.exception("scheduler step failed")
                self._fail_all(f"internal error: {type(e).__name__}: {e}")

    def _admit_waiting(self) -> None:
        free = [s for s in range(self.slots) if s not in self._running]
        while free:
            with self._lock:
                if not self._waiting:
                    return
                handle = self._waiting.popleft()
                self.metrics.set_queue(len(self._waiting), len(self._running))
            slot = free.pop(0)
            try:
                self._admit(handle, slot)
            except Exception as e:  # this request's failure is its own
                log.exception("admission failed")
                self._finish(handle, "error", error=f"{type(e).__name__}: {e}")

    def _admit(self, handle: Handle, slot: int) -> None:
        r = handle.request
        ids = np.zeros((1, self._bucket(len(r.ids))), np.int32)
        ids[0, : len(r.ids)] = r.ids
        stop = np.full((1, self.stop_width), -1, np.int32)
        stop_ids = (*self.tokenizer.eos_token_ids, *r.stop_ids)
        stop[0, : len(stop_ids)] = stop_ids
        seed = secrets.randbits(32) if r.seed is None else r.seed % (1 << 32)
        self._state = self._fns.admit(
            self.params, self._state, jnp.asarray([slot], jnp.int32), jnp.asarray(ids), jnp.asarray([len(r.ids)], jnp.int32),
            jnp.asarray([seed], jnp.uint32), jnp.asarray([r.max_new_tokens], jnp.int32), jnp.asarray(stop),
            self._row_rules([r.sampling]))
        handle.slot, handle.admitted = slot, time.perf_counter()
        handle.text = TextStream(self.tokenizer, r.stop)
        self._running[slot] = handle
        self.metrics.set_queue(len(self._waiting), len(self._running))

    def _run_segment(self) -> None:
        start = time.perf_counter()
        self._state = self._fns.decode(self.params, self._state, jnp.int32(self.segment))
        since = np.zeros((self.slots,), np.int32)
        for slot, h in self._running.items():
            since[slot] = len(h.request.ids) + h.read
        length, done, window, stats = jax.device_get(self._fns.report(self._state, jnp.asarray(since)))
        seconds = time.perf_counter() - start
        finished, new_tokens = [], 0
        for slot, h in list(self._running.items()):
            count = int(length[slot] - since[slot])
            tokens = window[slot, :count].tolist()
            h.read += count
            new_tokens += count
            if count and h.first_token is None:
                h.first_token = time.perf_counter()
            reason = None
            if done[slot]:
                ends = tokens and tokens[-1] in (*self.tokenizer.eos_token_ids, *h.request.stop_ids)
                reason = "stop" if ends else "length"
                tokens = tokens[:-1] if ends else tokens
            text, stopped = h.text.push(tokens)
            if stopped:
                reason = "stop"
            if reason is None:
                if text or tokens:
                    h.listener(Delta(text, tuple(tokens)))
                continue
            finished.append(h)
            self._finish(h, reason, text + h.text.flush(), tuple(tokens), row=_row_stats(stats, slot))
        self.metrics.add_segment(new_tokens, seconds)
        self._free([h.slot for h in finished if not done[h.slot]])
        for h in finished:
            del self._running[h.slot]
        with self._lock:
            self.metrics.set_queue(len(self._waiting), len(self._running))

    def _release(self, handles: list[Handle], reason: str) -> None:
        """Frees the slots of running requests (cancelled: their clients are gone)."""
        if not handles:
            return
        self._free([h.slot for h in handles])
        for h in handles:
            self._running.pop(h.slot, None)
            self._finish(h, reason)

    def _free(self, slots: list[int]) -> None:
        if slots:
            mask = np.zeros((self.slots,), bool)
            mask[slots] = True
            self._state = self._fns.release(self._state, jnp.asarray(mask))

    def _finish(self, h: Handle, reason: str, text: str = "", tokens: tuple[int, ...] = (), error: str | None = None,
                row: tuple = (0, 0, 0, ())) -> None:
        """Hands the request its last delta; `row`: its slot's (iterations, drafted, accepted, by depth)."""
        now = time.perf_counter()
        stats = RequestStats(
            prompt_tokens=len(h.request.ids), completion_tokens=len(h.text.ids) if h.text else 0, iterations=row[0], drafted=row[1],
            accepted=row[2], accepted_by_depth=row[3], queued_s=(h.admitted or now) - h.submitted,
            first_token_s=(h.first_token or now) - h.submitted, total_s=now - h.submitted,
        )
        self.metrics.finish_request(reason, stats)
        try:
            h.listener(Delta(text, tokens, reason, stats, error))
        except Exception:  # a listener's failure (a vanished client) is not the scheduler's
            log.exception("listener failed")

    def _fail_all(self, error: str) -> None:
        """Fails the running requests and starts again from free slots (the state may be lost)."""
        handles = list(self._running.values())
        self._running.clear()
        self._state = self._fns.empty(self.params, self._row_rules([SamplingConfig()] * self.slots), self.spec.budget(),
                                      self.stop_width)
        for h in handles:
            self._finish(h, "error", error=error)

    def _bucket(self, n: int) -> int:
        return min(max(MIN_PROMPT_BUCKET, 1 << (n - 1).bit_length()), self.max_len)

    def _row_rules(self, configs: list[SamplingConfig]) -> RowSampling:
        return RowSampling.of(configs, self.max_top_k)


def _row_stats(stats, slot: int) -> tuple:
    return (int(stats.iterations[slot]), int(stats.drafted[slot]), int(stats.accepted[slot]),
            tuple(int(x) for x in stats.accepted_by_depth[slot]))


@dataclasses.dataclass(frozen=True)
class _Programs:
    empty: Callable
    admit: Callable
    decode: Callable
    release: Callable
    report: Callable


@functools.lru_cache(maxsize=None)
def _programs(cfg, spec: SpecConfig, max_len: int, slots: int, window: int) -> _Programs:
    """The scheduler's jitted programs for one model, method and slot count (row rules throughout);
    admit and decode donate the state, so it is updated in place."""
    static = dict(cfg=cfg, spec=spec, sampling=None, max_len=max_len)
    keys = jax.vmap(jax.random.key)

    def empty(params, rules, budget, stop_width: int):
        """Every slot free (done), under the server's sparse budget."""
        state = engine.prefill(
            params, jnp.zeros((slots, 1), jnp.int32), jnp.ones((slots,), jnp.int32), keys(jnp.zeros((slots,), jnp.uint32)),
            max_new_tokens=jnp.ones((slots,), jnp.int32), stop_ids=-jnp.ones((slots, stop_width), jnp.int32),
            budget=budget, row_sampling=rules, **static)
        return engine.release(state, jnp.ones((slots,), bool))

    def admit(params, state, slots_, prompts, prompt_len, seeds, max_new_tokens, stop_ids, rules):
        return engine.admit(params, state, slots_, prompts, prompt_len, keys(seeds), max_new_tokens, stop_ids, rules, **static)

    def decode(params, state, iterations):
        return engine.decode(params, state, max_iterations=iterations, **static)

    def report(state, since):
        """(length, done, tokens [slots, window] from `since`, stats) for the host."""
        cols = since[:, None] + jnp.arange(window, dtype=jnp.int32)
        tokens = jnp.take_along_axis(state.tokens, jnp.minimum(cols, state.tokens.shape[1] - 1), axis=1)
        return state.length, state.done, tokens, state.stats

    return _Programs(
        empty=jax.jit(empty, static_argnums=3),
        admit=jax.jit(admit, donate_argnums=1),
        decode=jax.jit(decode, donate_argnums=1),
        release=jax.jit(engine.release, donate_argnums=0),
        report=jax.jit(report),
    )
