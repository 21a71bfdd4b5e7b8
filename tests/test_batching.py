"""Continuous batching in the engine (`engine.Engine.admit`, `engine.release`, row sampling rules): a request
admitted into a freed slot of a running batch, mid-flight, produces exactly the tokens it produces
alone (greedy rows and sampled rows with their own seeds and rules), for every method, a chain and a
tree; the rows already running are not disturbed; a released row stops changing."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import engine
from jaxspec.decoding.sampling import RowSampling, SamplingConfig
from jaxspec.decoding.spec import METHODS, SpecConfig
from jaxspec.models import decoder
from jaxspec.models.config import ModelConfig

CFG = ModelConfig(
    model_type="qwen3", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=128, qk_norm=True, dtype="float32",
)
MAX_LEN = 320
PROMPT_WIDTH = 256  # every prompt here is shorter
STOP_WIDTH = 2
GREEDY = SamplingConfig()
HOT = SamplingConfig(temperature=0.9, top_p=0.9, top_k=20)


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(CFG, jax.random.key(5), scale=0.1)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).astype(np.int32)


@functools.lru_cache(maxsize=None)
def compiled(spec: SpecConfig):
    """(admit, decode, release) jitted for `spec`, row rules (sampling None)."""
    eng = engine.Engine(CFG, spec, None, MAX_LEN)
    admit, decode = jax.jit(eng.admit, donate_argnums=1), jax.jit(eng.decode, donate_argnums=1)
    return admit, decode, jax.jit(engine.release, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def empty_state(params, spec: SpecConfig, slots: int):
    """A state of `slots` free rows (every row done), as a server starts."""
    state = engine.Engine(CFG, spec, None, MAX_LEN).prefill(
        params, jnp.zeros((slots, 1), jnp.int32), jnp.ones((slots,), jnp.int32), jax.random.key(0),
        max_new_tokens=jnp.ones((slots,), jnp.int32),
        stop_ids=-jnp.ones((slots, STOP_WIDTH), jnp.int32), row_sampling=RowSampling.of([GREEDY] * slots, max_top_k=32),
    )
    return engine.release(state, jnp.ones((slots,), bool))


class Request:
    def __init__(self, seed: int, n: int, max_new: int, rules: SamplingConfig):
        self.ids, self.max_new, self.rules, self.seed = prompt(seed, n), max_new, rules, seed


def admit(params, spec, state, slot: int, r: Request):
    """Admits `r` into `slot`, its prompt padded to PROMPT_WIDTH positions (the scheduler pads to its
    buckets too): one compiled admission serves every prompt here."""
    admit_fn = compiled(spec)[0]
    ids = np.pad(r.ids, (0, PROMPT_WIDTH - len(r.ids)))
    return admit_fn(
        params, state, jnp.asarray([slot]), jnp.asarray(ids[None]), jnp.asarray([len(r.ids)]),
        jax.random.key(r.seed)[None], jnp.asarray([r.max_new]), -jnp.ones((1, STOP_WIDTH), jnp.int32),
        RowSampling.of([r.rules], max_top_k=32), pages=slot_pages(state, [slot]), begin=jnp.zeros((1,), jnp.int32),
    )


def slot_pages(state, slots: list[int]):
    """The page tables of `slots` in a batch's pool: each slot its own consecutive pages (a slot past
    the rows, a padding row's: the null page)."""
    R = state.cache.pages.shape[1]
    rows = 1 + np.asarray(slots)[:, None] * R + np.arange(R)
    return jnp.asarray(np.where(np.asarray(slots)[:, None] < state.length.shape[0], rows, 0), jnp.int32)


def generated(state, slot: int) -> list[int]:
    tokens, length, prompt_len = jax.device_get((state.tokens[slot], state.length[slot], state.prompt_len[slot]))
    return tokens[prompt_len:length].tolist()


def alone(params, spec, r: Request) -> list[int]:
    state = admit(params, spec, empty_state(params, spec, 1), 0, r)
    return generated(compiled(spec)[1](params, state), 0)


# all_rows, last_accepted and stream share vegas's and quest's paths here: with the slow tests
SLOW = ("all_rows", "last_accepted", "stream")
# every method's admission into running slots is also in test_scheduler_admits_groups_... (vegas and
# quest by default): here every case is slow (the default run's 20 minutes)
SLOW_MID_FLIGHT = SLOW + ("plain", "vegas", "quest", "ngram")
SPECS = [pytest.param(SpecConfig(method=m, gamma=3, min_tokens=32), marks=[pytest.mark.slow] if m in SLOW_MID_FLIGHT else [], id=m)
         for m in METHODS if m not in ("full", "eagle")] + [  # full needs a draft model (test_engine), eagle a head (test_eagle_engine)
    pytest.param(SpecConfig(method="vegas", tree=(2, 2), traversal="dfs", min_tokens=32), id="vegas_tree",
                 marks=pytest.mark.slow)]  # by default: the scheduler's admissions into freed slots, below


@pytest.mark.parametrize("spec", SPECS)
def test_admitted_mid_flight_equals_alone(params, spec):
    spec = spec.validate()
    _, decode, release = compiled(spec)
    a, b = Request(1, 150, 40, GREEDY), Request(2, 60, 30, HOT)
    c, d = Request(3, 90, 24, GREEDY), Request(4, 200, 20, HOT)
    state = empty_state(params, spec, 3)
    state = admit(params, spec, state, 0, a)
    state = admit(params, spec, state, 1, b)
    state = decode(params, state, max_iterations=jnp.int32(3))
    a_part = generated(state, 0)
    state = release(state, jnp.asarray([True, False, False]))  # a is cancelled mid-flight
    state = decode(params, state, max_iterations=jnp.int32(1))
    assert generated(state, 0) == a_part  # a released row stops changing
    state = admit(params, spec, state, 0, c)  # c takes a's slot while b runs
    state = decode(params, state, max_iterations=jnp.int32(2))
    state = admit(params, spec, state, 2, d)  # d takes the slot that was never used
    state = decode(params, state, max_iterations=jnp.int32(1 << 30))
    assert bool(jax.device_get(state.done).all())
    for slot, r in ((1, b), (0, c), (2, d)):
        out = generated(state, slot)
        assert len(out) == r.max_new
        assert out == alone(params, spec, r), (slot, spec.method)
    assert a_part == alone(params, spec, a)[: len(a_part)]
    stats = jax.device_get(state.stats)
    if spec.method != "plain":
        assert stats.drafted[0] > 0 and stats.iterations[0] < c.max_new  # c's own stats, from zero


@pytest.mark.parametrize("spec", [pytest.param(SpecConfig(method="plain"), marks=pytest.mark.slow, id="plain"),
                                  pytest.param(SpecConfig(method="vegas", gamma=3, min_tokens=32), id="vegas",
                                               marks=pytest.mark.slow)])  # the default run's 20 minutes
def test_group_admission_drops_padding_rows(params, spec):
    """Three requests admitted in one prefill of four rows (the fourth, padding, aimed at slot 4 of
    4): each admitted row equals its request alone, the running row and the free row are untouched."""
    spec = spec.validate()
    _, decode, _ = compiled(spec)
    first, group = Request(5, 70, 30, HOT), [Request(6, 40, 16, GREEDY), Request(7, 100, 12, HOT), Request(8, 60, 20, GREEDY)]
    state = admit(params, spec, empty_state(params, spec, 5), 3, first)
    state = decode(params, state, max_iterations=jnp.int32(2))
    free_before = jax.device_get(state.tokens[4])
    rows = group + [group[-1]]
    width = max(len(r.ids) for r in rows)
    ids = np.stack([np.pad(r.ids, (0, width - len(r.ids))) for r in rows])
    state = compiled(spec)[0](
        params, state, jnp.asarray([0, 1, 2, 5]), jnp.asarray(ids), jnp.asarray([len(r.ids) for r in rows]),
        jax.vmap(jax.random.key)(jnp.asarray([r.seed for r in rows])), jnp.asarray([r.max_new for r in rows]),
        -jnp.ones((4, STOP_WIDTH), jnp.int32), RowSampling.of([r.rules for r in rows], max_top_k=32),
        pages=slot_pages(state, [0, 1, 2, 5]), begin=jnp.zeros((4,), jnp.int32))
    assert (jax.device_get(state.tokens[4]) == free_before).all() and bool(state.done[4])
    state = decode(params, state, max_iterations=jnp.int32(1 << 30))
    for slot, r in ((0, group[0]), (1, group[1]), (2, group[2]), (3, first)):
        assert generated(state, slot) == alone(params, spec, r), slot


def submit_all(scheduler, requests: list[Request]) -> tuple[dict, dict]:
    """Submits `requests` to a scheduler; returns ({i: tokens handed out}, {i: last delta}), filled as
    the scheduler runs."""
    from jaxspec.serving.requests import Request as Job

    tokens, finished = {i: [] for i in range(len(requests))}, {}

    def listener(i):
        def hear(delta):
            tokens[i].extend(delta.token_ids)
            if delta.finish_reason:
                finished[i] = delta
        return hear

    for i, r in enumerate(requests):
        scheduler.submit(Job(tuple(r.ids.tolist()), r.max_new, r.rules, r.seed), listener(i))
    return tokens, finished


# plain's and ngram's admissions (no drafter state but the tokens, which every method admits) are
# slow too, and selections every 3rd iteration (test_engine checks them lossless): the default run's 20 minutes
SCHEDULER_CASES = [pytest.param("vegas", None, 1, id="vegas"), pytest.param("vegas", 32, 1, id="vegas-chunked", marks=pytest.mark.slow),
                   pytest.param("vegas", None, 3, id="vegas-select-every-3", marks=pytest.mark.slow)] + [
    pytest.param(m, None, 1, id=m, marks=[pytest.mark.slow] if m in SLOW + ("plain", "ngram", "quest") else [])
    for m in METHODS if m not in ("vegas", "full", "eagle")]


@pytest.mark.parametrize("method, chunk, every", SCHEDULER_CASES)
def test_scheduler_admits_groups_and_hands_out_first_tokens_at_once(params, method, chunk, every, monkeypatch):
    """The scheduler (no tokenizer: token ids only) with three slots and group admission: five
    requests, the first three admitted in one prefill and handed their first token before any
    segment runs (with chunked prefill of 32 positions: once their last chunk is written, a chunk
    per round), the others admitted into freed slots; each emits its tokens alone. With a selection
    every third iteration a segment of two runs three, and its report must still hold their tokens.
    Segments are pipelined: each segment's report is read with the next segment already queued
    behind it (on the dispatch thread: the device does not wait on the host's hand-out); admissions
    read theirs at once, a report that covers the segment queued ahead."""
    from jaxspec.serving import scheduler as serving

    spec = SpecConfig(method=method, gamma=3, min_tokens=32, select_every=every).validate()
    requests = [Request(10 + i, 30 + 20 * i, [12, 30, 8, 20, 16][i], [GREEDY, HOT][i % 2]) for i in range(5)]
    scheduler = serving.Scheduler(params, CFG, None, spec, slots=3, max_len=MAX_LEN, admit_rows=None, max_top_k=32,
                                  prefill_chunk=chunk)
    events, call, queue, get = [], scheduler._call, scheduler._queue, jax.device_get
    monkeypatch.setattr(scheduler, "_call", lambda program, *a, **k: (events.append(program.name), call(program, *a, **k))[1])
    monkeypatch.setattr(scheduler, "_queue",
                        lambda program, *a, **k: (events.append(program.name), queue(program, *a, **k))[1])
    monkeypatch.setattr(serving.jax, "device_get", lambda x: (events.append("read"), get(x))[1])
    tokens, finished = submit_all(scheduler, requests)
    rounds = 1 if chunk is None else -(-(max(len(r.ids) for r in requests[:3]) - 1) // chunk)  # chunks of the first group
    for _ in range(rounds - 1):
        scheduler.admit_waiting()
        assert not any(tokens.values())
    scheduler.admit_waiting()
    assert [len(tokens[i]) for i in range(5)] == [1, 1, 1, 0, 0]
    while len(finished) < 5:
        scheduler.step()
    reads = [tuple(events[i - 2 : i]) for i, e in enumerate(events) if e == "read"]
    admissions = {(admission, "report") for admission in ("prefill", "start", "admit", "admit_prefilled")}
    assert all(r in admissions or r[1] == "decode" for r in reads), reads
    queued, read, ahead = 0, 0, []  # segments queued and read; at each segment's read, how many are queued behind it
    for e, nxt in zip(events, events[1:]):
        queued += e == "decode"
        if e == "report":  # a report of the state: it covers every segment queued
            read = queued
        elif nxt == "read":  # a segment's report
            read += 1
            ahead.append(queued - read)
    assert len(ahead) >= 3 and set(ahead) == {1}, ahead
    for i, r in enumerate(requests):
        assert finished[i].finish_reason == "length" and tokens[i] == alone(params, spec, r), i
        assert finished[i].stats.completion_tokens == r.max_new and finished[i].stats.iterations > 0


def test_a_failed_segment_fails_its_request_and_the_server_goes_on(params):
    """A segment whose program fails on the dispatch thread (the third decode call here, with the next
    segment queued behind it) ends the running request with an internal error; the scheduler's thread
    goes on, and the next request runs from a fresh state to exactly its tokens alone."""
    import time

    from jaxspec.serving import scheduler as serving

    spec = SpecConfig(method="plain").validate()
    first, second = Request(20, 40, 30, GREEDY), Request(21, 50, 12, HOT)
    scheduler = serving.Scheduler(params, CFG, None, spec, slots=1, max_len=MAX_LEN, max_top_k=32)
    scheduler.warm_up()
    key = (scheduler._programs().decode, ())
    decode, calls = scheduler._executables[key], []

    def failing_third(*args):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("the device fell over")
        return decode(*args)

    scheduler._executables[key] = failing_third

    def served(r: Request):
        tokens, finished = submit_all(scheduler, [r])
        deadline = time.monotonic() + 120
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished, "the request never finished"
        return tokens[0], finished[0]

    scheduler.start()
    try:
        _, failed = served(first)
        tokens, last = served(second)
    finally:
        scheduler.stop()
    assert failed.finish_reason == "error" and "the device fell over" in failed.error
    assert len(calls) > 3 and last.finish_reason == "length" and tokens == alone(params, spec, second)


def test_a_failed_segment_queued_ahead_fails_the_requests_it_ran_only(params):
    """The segment queued ahead fails while a request arrives: the running request ends with the
    internal error, and the new one (admitted next, onto a fresh state) emits its tokens alone, not the
    failure of work that never ran it."""
    import time

    from jaxspec.serving import scheduler as serving
    from jaxspec.serving.requests import Request as Job

    spec = SpecConfig(method="plain").validate()
    first, second = Request(20, 40, 30, GREEDY), Request(21, 50, 12, HOT)
    scheduler = serving.Scheduler(params, CFG, None, spec, slots=2, max_len=MAX_LEN, max_top_k=32)
    scheduler.warm_up()
    key = (scheduler._programs().decode, ())
    decode, calls, tokens, finished = scheduler._executables[key], [], [], {}

    def failing_second(*args):  # the first segment queued ahead of another
        calls.append(len(calls))
        if len(calls) == 2:
            scheduler.submit(Job(tuple(second.ids.tolist()), second.max_new, second.rules, second.seed),
                             lambda d: (tokens.extend(d.token_ids), d.finish_reason and finished.update(second=d)))
            raise RuntimeError("the device fell over")
        return decode(*args)

    scheduler._executables[key] = failing_second
    scheduler.submit(Job(tuple(first.ids.tolist()), first.max_new, first.rules, first.seed),
                     lambda d: d.finish_reason and finished.update(first=d))
    scheduler.start()
    try:
        deadline = time.monotonic() + 120
        while len(finished) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert finished["first"].finish_reason == "error" and "the device fell over" in finished["first"].error
    assert finished["second"].finish_reason == "length" and tokens == alone(params, spec, second)


def test_an_admission_that_fails_after_another_leaves_that_one_its_own_tokens(params, monkeypatch):
    """One round admits a request into a slot freed under a segment queued ahead, then fails the next
    request's admission: the first still emits exactly its tokens alone (the report of the segment
    queued ahead is of the slot's former request), the failed one ends with its error, and the running
    request is undisturbed."""
    from jaxspec.serving.scheduler import Scheduler

    spec = SpecConfig(method="plain").validate()
    scheduler = Scheduler(params, CFG, None, spec, slots=3, max_len=MAX_LEN, admit_rows=1, max_top_k=32, segment=2)
    running, short, admitted, failing = (Request(1, 40, 60, GREEDY), Request(2, 120, 3, GREEDY),
                                         Request(3, 30, 10, GREEDY), Request(4, 30, 10, GREEDY))
    tokens, finished = submit_all(scheduler, [running, short])
    while 1 not in finished:
        scheduler.step()
    assert scheduler._pending is not None  # a segment queued ahead, its report of the short request's slot
    admission = scheduler._admission

    def fails_for_the_second(group, slots, n, width):
        if any(h.request.ids == tuple(failing.ids.tolist()) for h in group):
            raise RuntimeError("no admission for you")
        return admission(group, slots, n, width)

    monkeypatch.setattr(scheduler, "_admission", fails_for_the_second)
    later_tokens, later = submit_all(scheduler, [admitted, failing])
    with pytest.raises(RuntimeError, match="no admission"):
        scheduler.step()
    while len(later) < 2 or 0 not in finished:
        scheduler.step()
    assert later[1].finish_reason == "error" and "no admission" in later[1].error
    assert later[0].finish_reason == "length" and later_tokens[0] == alone(params, spec, admitted)
    assert finished[0].finish_reason == "length" and tokens[0] == alone(params, spec, running)


def test_a_cancel_during_admission_or_before_a_preemption_ends_the_request(params):
    """A cancel that arrives after a request left the queue but before it has a slot (its admission
    waits for the segment queued ahead) frees its slot once it runs; one that arrives before the
    request is preempted ends it instead of queueing it again."""
    import threading

    from jaxspec.serving.requests import Request as Job
    from jaxspec.serving.scheduler import Scheduler

    spec = SpecConfig(method="plain").validate()
    scheduler = Scheduler(params, CFG, None, spec, slots=2, max_len=MAX_LEN, max_top_k=32)
    submit_all(scheduler, [Request(1, 40, 60, GREEDY)])
    scheduler.step()
    scheduler.step()
    assert scheduler._pending is not None
    done = {}
    job = Request(2, 30, 50, GREEDY)
    handle = scheduler.submit(Job(tuple(job.ids.tolist()), job.max_new), lambda d: d.finish_reason and done.update(d=d))
    admit = scheduler._admit

    def cancelled_while_admitted(group, slots, *args, **kwargs):
        if handle in group:  # out of the queue, not yet in a slot: the server's thread cancels now
            thread = threading.Thread(target=handle.cancel)
            thread.start()
            thread.join()
        return admit(group, slots, *args, **kwargs)

    scheduler._admit = cancelled_while_admitted
    for _ in range(20):
        if "d" in done:
            break
        scheduler.step()
    assert done["d"].finish_reason == "cancelled" and done["d"].stats.completion_tokens < job.max_new

    scheduler._admit = admit
    late = {}
    handle = scheduler.submit(Job(tuple(job.ids.tolist()), job.max_new), lambda d: d.finish_reason and late.update(d=d))
    scheduler.step()
    handle.cancel()  # then preempted before the next round frees its slot
    scheduler._preempt(handle)
    assert late["d"].finish_reason == "cancelled" and handle not in scheduler._waiting


def test_static_batching_admits_only_into_an_empty_batch(params):
    """`serve --batching static`'s gate: a waiting request is admitted only once every running one
    has finished (not into the first freed slot, as continuous batching does), and emits its tokens alone."""
    from jaxspec.serving import scheduler as serving

    spec = SpecConfig(method="vegas", gamma=3, min_tokens=32).validate()
    requests = [Request(40, 30, 4, GREEDY), Request(41, 50, 20, GREEDY), Request(42, 40, 8, GREEDY)]
    scheduler = serving.Scheduler(params, CFG, None, spec, slots=2, max_len=MAX_LEN, max_top_k=32, static=True)
    tokens, finished = submit_all(scheduler, requests)
    scheduler.admit_waiting()
    assert [len(tokens[i]) for i in range(3)] == [1, 1, 0]
    held_back = 0
    while 1 not in finished:
        scheduler.step()
        assert not tokens[2], "admitted while a row of the static batch still ran"
        held_back += 0 in finished
    assert held_back > 0  # a slot stood free while request 1 ran
    while len(finished) < 3:
        scheduler.step()
    for i, r in enumerate(requests):
        assert finished[i].finish_reason == "length" and tokens[i] == alone(params, spec, r), i


def test_cancel_during_chunked_prefill(params):
    """A request cancelled while its prompt is prefilled a chunk per round ends cancelled once
    admitted, and its slot goes to the next request, which emits its tokens alone."""
    from jaxspec.serving.requests import Request as Job
    from jaxspec.serving.scheduler import Scheduler

    spec = SpecConfig(method="vegas", gamma=3, min_tokens=32).validate()
    long, short = Request(20, 150, 40, HOT), Request(21, 40, 12, GREEDY)
    scheduler = Scheduler(params, CFG, None, spec, slots=1, max_len=MAX_LEN, max_top_k=32, prefill_chunk=32)
    finished, tokens = {}, []
    handle = scheduler.submit(Job(tuple(long.ids.tolist()), long.max_new, long.rules, long.seed),
                              lambda d: d.finish_reason and finished.update(long=d))
    scheduler.submit(Job(tuple(short.ids.tolist()), short.max_new, short.rules, short.seed),
                     lambda d: (tokens.extend(d.token_ids), d.finish_reason and finished.update(short=d)))
    scheduler.step()  # the long prompt's first chunk
    handle.cancel()
    while len(finished) < 2:
        scheduler.step()
    assert finished["long"].finish_reason == "cancelled" and finished["long"].stats.completion_tokens < long.max_new
    assert finished["short"].finish_reason == "length" and tokens == alone(params, spec, short)


def test_model_end_tokens_end_a_request_unless_it_ignores_them(params):
    """A token of the model's own stop ids ends a request there ("stop", the token withheld); the same
    request with ignore_eos runs to max_tokens and emits its tokens alone."""
    from jaxspec.serving.requests import Request as Job
    from jaxspec.serving.scheduler import Scheduler

    spec = SpecConfig(method="vegas", gamma=3, min_tokens=32).validate()
    r = Request(22, 40, 16, GREEDY)
    want = alone(params, spec, r)
    end = next(t for i, t in enumerate(want) if i >= 3 and t not in want[:i])  # a first occurrence past the start
    scheduler = Scheduler(params, CFG, None, spec, slots=2, max_len=MAX_LEN, max_top_k=32, stop_ids=(end,))
    finished, tokens = {}, {True: [], False: []}
    for ignore in (False, True):
        scheduler.submit(Job(tuple(r.ids.tolist()), r.max_new, r.rules, r.seed, ignore_eos=ignore),
                         lambda d, ignore=ignore: (tokens[ignore].extend(d.token_ids), d.finish_reason and finished.update({ignore: d})))
    while len(finished) < 2:
        scheduler.step()
    assert finished[False].finish_reason == "stop" and tokens[False] == want[: want.index(end)]
    assert finished[True].finish_reason == "length" and tokens[True] == want


def test_a_watch_window_ends_on_the_iterations_its_rows_ran(params):
    """A server's watch window ends once a running row has run the window's iterations, also when a
    row freed before the window holds a larger count (its count does not move: the maxima's
    difference would stay 0 and the window never end)."""
    import types

    from jaxspec import planner
    from jaxspec.planner import Prediction, Strategy
    from jaxspec.serving.scheduler import Scheduler, _Segment

    plain, ngram = Strategy(), Strategy("ngram", gamma=3)
    plan = planner.Plan(tuple(Prediction(s, 100.0, 2.0, 0.02) for s in (plain, ngram)), plain, "test", 1024)
    scheduler = Scheduler(params, CFG, None, SpecConfig(), slots=2, max_len=MAX_LEN, plan=plan, max_top_k=32)
    window = scheduler.refinement.window
    report = lambda *iterations: (None, types.SimpleNamespace(iterations=np.asarray(iterations)))
    scheduler._watch_from = (report(900, 10), 0.0)  # row 0 was freed at 900 iterations
    segment = _Segment(None, None, 0.0, None, 8)
    assert scheduler._ends_window(report(900, 10 + window - 8), segment)
    assert not scheduler._ends_window(report(900, 10 + window - 9), segment)
    assert scheduler._watched(report(900, 10 + window)) == window


@pytest.mark.slow  # by default: test_planner's switches keep greedy output, and its CLI auto run end to end
def test_auto_switches_while_serving(params, monkeypatch):
    """A scheduler given a plan refines while requests come and go: scripted decisions switch every
    slot vegas -> plain -> ngram mid-flight; each greedy request still emits plain decoding's tokens,
    and its stats count its iterations under every strategy."""
    from jaxspec import planner
    from jaxspec.planner import Prediction, Strategy, refine
    from jaxspec.serving.scheduler import Scheduler

    vegas, plain, ngram = Strategy("vegas", gamma=3, ratio=0.07), Strategy(), Strategy("ngram", gamma=3)
    script = iter([(plain, "scripted"), (ngram, "scripted"), (ngram, "scripted")])
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: next(script))
    plan = planner.Plan(tuple(Prediction(s, 100.0, 2.0, 0.02) for s in (vegas, plain, ngram)), vegas, "test", 1024)
    base = SpecConfig(min_tokens=32)
    scheduler = Scheduler(params, CFG, None, base, slots=2, max_len=MAX_LEN, plan=plan, max_top_k=32)
    requests = [Request(30 + i, 40 + 25 * i, [40, 12, 36][i], GREEDY) for i in range(3)]
    tokens, finished = submit_all(scheduler, requests)  # the third waits for the second's slot, admitted after a switch
    while len(finished) < 3:
        scheduler.step()
    r = scheduler.refinement
    assert [(s["from"], s["to"]) for s in r.switches] == [(vegas.name, "plain"), ("plain", ngram.name)]
    assert scheduler.spec.method == "ngram" and not r.active
    plain_spec = SpecConfig(method="plain").validate()
    for i, req in enumerate(requests):
        assert tokens[i] == alone(params, plain_spec, req), i
    first = finished[0].stats  # ran under all three strategies
    assert first.iterations > 2 * planner.SEGMENT and len(first.accepted_by_depth) == 3 and first.drafted > 0


@pytest.mark.slow  # the default run's 20 minutes: the refinement's segments are test_planner's, a server's test_server's
def test_an_idle_server_goes_on_refining(params, monkeypatch):
    """A request that ends inside the refinement's first segment leaves the server idle, not its
    choice settled: the next requests are refined on (here a scripted switch vegas -> plain), and
    their greedy tokens are plain decoding's."""
    from jaxspec import planner
    from jaxspec.planner import Prediction, Strategy, refine
    from jaxspec.serving.scheduler import Scheduler

    vegas, plain = Strategy("vegas", gamma=3, ratio=0.07), Strategy()
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (plain, "scripted"))
    plan = planner.Plan(tuple(Prediction(s, 100.0, 2.0, 0.02) for s in (vegas, plain)), vegas, "test", 1024)
    scheduler = Scheduler(params, CFG, None, SpecConfig(min_tokens=32), slots=2, max_len=MAX_LEN, plan=plan,
                          max_top_k=32)
    short = Request(60, 50, 2, GREEDY)  # done within the first segment's iterations
    _, finished = submit_all(scheduler, [short])
    while not finished:
        scheduler.step()
    r = scheduler.refinement
    assert r.active and r.current == vegas and len(r.segments) == 1
    requests = [Request(61 + i, 40 + 30 * i, 30, GREEDY) for i in range(2)]
    tokens, finished = submit_all(scheduler, requests)
    while len(finished) < 2:
        scheduler.step()
    assert [(s["from"], s["to"]) for s in r.switches] == [(vegas.name, "plain")]
    plain_spec = SpecConfig(method="plain").validate()
    for i, req in enumerate(requests):
        assert tokens[i] == alone(params, plain_spec, req), i


def test_warm_up_compiles_what_serving_runs(params, monkeypatch):
    """A server warmed up for prompts of up to 128 tokens, refining ngram g3 (it replays ngram g2
    over every segment and watch window), compiles nothing while it serves prompts of 40-90 tokens:
    the replay and both prompt buckets came with the warm-up (in a server a compile is time the
    waiting requests lose), and it made the segment's first calls (`Scheduler.load`). /v1/models reports
    the refinement."""
    from starlette.testclient import TestClient

    from jaxspec import planner
    from jaxspec.planner import Prediction, Strategy, refine
    from jaxspec.serving.programs import clear_executables, replays
    from jaxspec.serving.scheduler import Scheduler
    from jaxspec.serving.server import create_app

    g3, g2 = Strategy("ngram", gamma=3), Strategy("ngram", gamma=2)
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (current, "scripted"))
    plan = planner.Plan(tuple(Prediction(s, 100.0, 2.0, 0.02) for s in (g3, g2, Strategy())), g3, "test", 1024)
    scheduler = Scheduler(params, CFG, None, SpecConfig(min_tokens=32), slots=2, max_len=MAX_LEN, plan=plan,
                          max_top_k=32)
    clear_executables()  # no program of this process has run: the warm-up makes the first calls
    scheduler.warm_up(128)  # prompts of up to 128 tokens: buckets 64 and 128
    assert scheduler.load_s > 0
    compiled_s, programs = scheduler.compile_s, set(scheduler._executables)
    assert (replays(CFG, (g2.spec(scheduler.base),), MAX_LEN), scheduler._state.tokens.shape) in programs
    requests = [Request(30 + i, 40 + 25 * i, [40, 12, 36][i], GREEDY) for i in range(3)]  # buckets 64 and 128
    tokens, finished = submit_all(scheduler, requests)
    while len(finished) < 3:
        scheduler.step()
    segments = scheduler.refinement.segments
    assert segments and all(g2.name in s["replayed_tokens_per_iteration"] for s in segments)
    report = scheduler.refinement.describe()
    assert report["planned"]["strategy"] == report["current"] == g3.name and report["switches"] == []
    assert report["segments"] == len(segments) and not report["refining"]
    models = TestClient(create_app(scheduler, "tiny")).get("/v1/models").json()
    assert models["data"][0]["jaxspec"]["auto"] == json.loads(json.dumps(report))
    assert set(scheduler._executables) == programs and scheduler.compile_s == compiled_s
    for i, req in enumerate(requests):
        assert tokens[i] == alone(params, SpecConfig(method="plain").validate(), req), i


@pytest.mark.parametrize("spec", [pytest.param(SpecConfig(method="vegas", gamma=3, min_tokens=32), id="vegas",
                                               marks=pytest.mark.slow),  # opt-in; the runner's shrink runs by default
                                  pytest.param(SpecConfig(method="vegas", tree=(2, 2), traversal="dfs", min_tokens=32),
                                               id="vegas_tree", marks=pytest.mark.slow),
                                  pytest.param(SpecConfig(method="quest", gamma=3, min_tokens=32), id="quest",
                                               marks=pytest.mark.slow)])
def test_scheduler_shrinks_and_grows(params, spec):
    """A server's scheduler with `shrink`, warmed up: once at most 2 of its 8 slots run it moves them
    into a state of 2 rows, grows back to 8 for two waiting requests, and shrinks again; nothing
    compiles after the warm-up, and each request, the rows that moved among them, emits its tokens
    alone."""
    from jaxspec.serving.scheduler import Scheduler

    spec = spec.validate()
    lengths = [60, 5, 8, 6, 50, 7, 5, 9, 20, 14]  # requests 0 and 4 outlive the six short ones
    requests = [Request(50 + i, 70 + 5 * i, n, [GREEDY, HOT][i % 2]) for i, n in enumerate(lengths)]
    scheduler = Scheduler(params, CFG, None, spec, slots=8, max_len=MAX_LEN, max_top_k=32, segment=2, shrink=True)
    scheduler.warm_up(128)  # the prompts' bucket
    compiled_s = scheduler.compile_s
    tokens, finished = submit_all(scheduler, requests[:8])
    while len(finished) < 6:
        scheduler.step()
    assert scheduler.rows == 2 and sorted(h.slot for h in scheduler._running.values()) == [0, 1]
    later_tokens, later_finished = submit_all(scheduler, requests[8:])
    scheduler.step()
    assert scheduler.rows == 8 and len(scheduler._running) == 4  # grown back from 2 rows, both admitted
    while len(finished) < 8 or len(later_finished) < 2:
        scheduler.step()
    assert scheduler.rows == 2  # shrunk again once at most 2 ran
    assert scheduler.compile_s == compiled_s  # every program was compiled by the warm-up
    for i, r in enumerate(requests[:8]):
        assert tokens[i] == alone(params, spec, r), i
    for i, r in enumerate(requests[8:]):
        assert later_tokens[i] == alone(params, spec, r), i


def test_a_batch_shrinks_as_its_rows_finish(params, monkeypatch):
    """The runner's static batch (one sampling config, no row rules) with `shrink`: rows of longer
    prompts reach the length cap first, the decode stops once at most a quarter of the 8 rows run
    (`engine.Engine.decode`'s min_live) and the batch shrinks to 2 rows; every row's tokens equal the batch's
    without shrinking, and a device without the memory for the smaller state keeps the 8 rows and
    decodes to the end."""
    from jaxspec.runner import Batch, run_generation
    from jaxspec.serving.scheduler import Scheduler

    shrunk = []
    shrink = Scheduler._shrink
    monkeypatch.setattr(Scheduler, "_shrink", lambda self: (shrink(self), shrunk.append(self.rows)))
    spec = SpecConfig(method="vegas", gamma=3, min_tokens=32).validate()
    lengths = [40, 280, 60, 300, 250, 50, 290, 270]  # the cap at 320 leaves rows 1, 3, 4, 6, 7 20 to 70 tokens
    ids = np.zeros((8, max(lengths)), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = prompt(60 + b, n)
    batch = Batch(ids, np.asarray(lengths, np.int32))
    common = dict(spec=spec, sampling=HOT, max_len=MAX_LEN, max_new_tokens=200, stop_ids=(), seed=9)
    runs = [run_generation(params, CFG, batch, shrink=s, **common) for s in (True, False)]
    assert shrunk == [2], shrunk  # a state of 2 rows shrinks no further (2 // SHRINK_FACTOR = 0)
    assert runs[1].compile_s == 0  # the first run's programs serve the next (the process's executables)

    class Full:  # a device without the memory for a second state
        def memory_stats(self):
            return {"bytes_limit": 1 << 30, "bytes_in_use": 1 << 30}

    monkeypatch.setattr(jax, "local_devices", lambda: [Full()])
    runs.append(run_generation(params, CFG, batch, shrink=True, **common))  # turns shrinking off and decodes on
    assert shrunk == [2, 8] and runs[2].compile_s == 0
    outputs = [[g.tolist() for g in run.generated()] for run in runs]
    assert outputs[0] == outputs[1] == outputs[2]
    assert [len(g) for g in outputs[0]] == [min(200, MAX_LEN - n) for n in lengths]
    stats = [jax.device_get(run.output.stats) for run in runs]
    assert (stats[0].iterations == stats[1].iterations).all() and (stats[0].accepted == stats[1].accepted).all()
