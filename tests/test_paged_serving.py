"""The scheduler over a shared paged KV pool (`Scheduler(kv_pages=...)`, `serving.pages`): more requests run
at once than the pool holds rows of the context, a pool that runs out preempts and re-admits, a shared
prompt prefix is read from cached pages that no other row writes, and every greedy request still emits
exactly its tokens alone. Pages of 64 slots, so a row's pages scatter through the pool as it grows."""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from starlette.testclient import TestClient

from jaxspec.decoding import engine
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder
from jaxspec.models.config import NSAConfig
from jaxspec.serving.requests import Request as Job
from jaxspec.serving.scheduler import Scheduler
from jaxspec.serving.server import create_app
from test_batching import CFG, GREEDY, MAX_LEN, Request, alone, prompt, submit_all

PAGE = 64
POOL = 9  # 8 pages and the null page: 512 slots, 1.6 rows of MAX_LEN; 4 short requests (2 pages each) fit at once
SPECS = {"plain": SpecConfig(method="plain"), "vegas": SpecConfig(method="vegas", gamma=3, min_tokens=32)}


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(CFG, jax.random.key(5), scale=0.1)  # test_batching's model


def scheduler(params, spec: SpecConfig, *, kv_pages: int = POOL, prefix_cache: bool = True) -> Scheduler:
    return Scheduler(params, CFG, None, spec.validate(), slots=4, max_len=MAX_LEN, max_top_k=32, kv_pages=kv_pages,
                     page_size=PAGE, prefix_cache=prefix_cache)


def serve_all(s: Scheduler, requests: list[Request]) -> tuple[dict, dict, int]:
    """Runs `requests` to the end: ({i: tokens}, {i: last delta}, the most requests that ran at once)."""
    tokens, finished = submit_all(s, requests)
    most = 0
    while len(finished) < len(requests):
        s.step()
        most = max(most, len(s._running))
    return tokens, finished, most


def assert_pool_idle(s: Scheduler) -> None:
    """Nothing runs: no page is in use, and no row's table points at a page the pool may hand out."""
    assert s.pool.in_use == 0 and not np.asarray(s.state.cache.pages).any()


@pytest.mark.parametrize("method", ["plain", "vegas"])
def test_more_requests_run_than_rows_of_the_pool(params, method):
    """Six short requests on four slots over a pool of 1.6 context rows: four run at once, each on pages of
    its own, no request is preempted, and each emits its tokens alone."""
    spec = SPECS[method].validate()
    requests = [Request(70 + i, [30, 40, 20, 36, 44, 25][i], [20, 16, 24, 12, 18, 14][i], GREEDY) for i in range(6)]
    s = scheduler(params, spec)
    tokens, finished = submit_all(s, requests)
    s.step()  # four admitted, each with the pages of its prompt and first segments
    tables = np.asarray(s.state.cache.pages)[:, :2]
    assert len(s._running) == 4 > (POOL - 1) * PAGE // MAX_LEN
    assert sorted(tables.ravel()) == list(range(1, POOL))
    while len(finished) < len(requests):
        s.step()
    assert s.metrics.preemptions == 0
    for i, r in enumerate(requests):
        assert finished[i].finish_reason == "length" and tokens[i] == alone(params, spec, r), i
    assert_pool_idle(s)


@pytest.mark.parametrize("method", ["plain", "vegas"])
def test_a_full_pool_preempts_and_every_request_equals_alone(params, method):
    """A request that grows by two pages to six of the pool's 8, admitted first, and a growing one beside
    it (admitted with the one page a growing row is left): the pool runs out, the most recently admitted request is preempted and re-admitted with the tokens it had
    (its prompt's whole page read back from the prefix cache, where its release left it); every request
    still emits its tokens alone, and the /metrics counter counts the preemptions."""
    spec = SPECS[method].validate()
    requests = [Request(82, 150, MAX_LEN - 150, GREEDY), Request(80, 70, 100, GREEDY), Request(81, 40, 20, GREEDY),
                Request(83, 20, 30, GREEDY)]
    s = scheduler(params, spec)
    tokens, finished, _ = serve_all(s, requests)
    assert s.metrics.preemptions > 0
    assert s.pool.hit_tokens >= PAGE  # the preempted request's prompt page, read back
    assert f"jaxspec_preemptions_total {s.metrics.preemptions}" in s.metrics.render()
    for i, r in enumerate(requests):
        assert finished[i].finish_reason == "length" and tokens[i] == alone(params, spec, r), i
        assert finished[i].stats.completion_tokens == r.max_new
    assert_pool_idle(s)


def shared_prefix_requests() -> list[Request]:
    """A prompt of two whole pages, a longer one that starts with it, and the same prompt again."""
    first, longer, again = Request(90, 2 * PAGE, 8, GREEDY), Request(91, 30, 12, GREEDY), Request(90, 2 * PAGE, 10, GREEDY)
    longer.ids = np.concatenate([first.ids, longer.ids])
    return [first, longer, again]


def test_a_shared_prefix_is_read_from_cached_pages(params):
    """After a prompt of two whole pages has run, a longer prompt that starts with it reads both pages
    from the cache (cached_tokens 128), the same prompt again the first page (never its last token's),
    and the hit rate counts them; the cached pages' keys and values are the same after both ran (no
    other row wrote them); every output equals the one with prefix caching off and alone."""
    spec = SPECS["vegas"].validate()
    first, *later = shared_prefix_requests()
    outputs = {}
    for cache in (True, False):
        s = scheduler(params, spec, prefix_cache=cache)
        tokens, finished, _ = serve_all(s, [first])
        pages = sorted(s.pool._key_of)
        assert len(pages) == (2 if cache else 0) and finished[0].stats.cached_tokens == 0
        slots = np.asarray([p * PAGE + i for p in pages for i in range(PAGE)], int)
        before = [np.asarray(x[:, :, slots]) for x in (s.state.cache.k, s.state.cache.v)]
        later_tokens, later_finished, most = serve_all(s, later)
        assert most == 2 and s.metrics.preemptions == 0
        assert [later_finished[i].stats.cached_tokens for i in range(2)] == ([2 * PAGE, PAGE] if cache else [0, 0])
        assert (s.pool.hit_rate > 0) == cache
        assert ("jaxspec_prefix_cache_hit_rate 0.0000" in s.metrics.render()) != cache
        after = [np.asarray(x[:, :, slots]) for x in (s.state.cache.k, s.state.cache.v)]
        assert all((b == a).all() for b, a in zip(before, after))
        outputs[cache] = [tokens[0], later_tokens[0], later_tokens[1]]
        assert_pool_idle(s)
    assert outputs[True] == outputs[False]
    for out, r in zip(outputs[True], [first, *later]):
        assert out == alone(params, spec, r)


def test_bad_pool_configurations(params):
    """A page size the kernels cannot tile and a pool smaller than one request of the whole context
    fail at construction; on the smallest pool, a request of the whole context is accepted and one
    beyond it is a JaxspecError from `check` (an HTTP 400)."""
    spec = SPECS["plain"]
    with pytest.raises(JaxspecError, match="multiple of 64"):
        Scheduler(params, CFG, None, spec, slots=2, max_len=MAX_LEN, kv_pages=POOL, page_size=96)
    row = 6  # pages of a row of MAX_LEN and a draft tree: (320 + 64) / 64
    with pytest.raises(JaxspecError, match="fewer than one request"):
        Scheduler(params, CFG, None, spec, slots=2, max_len=MAX_LEN, kv_pages=row, page_size=PAGE)
    s = Scheduler(params, CFG, None, spec, slots=2, max_len=MAX_LEN, kv_pages=row + 1, page_size=PAGE)
    ids = tuple(prompt(95, 250).tolist())
    s.check(Job(ids, MAX_LEN - 250))
    with pytest.raises(JaxspecError, match="context"):
        s.check(Job(ids, MAX_LEN - 249))


def test_server_usage_reports_cached_tokens(params):
    """The server's usage carries `prompt_tokens_details.cached_tokens`; /metrics the pool's pages and
    the prefix cache's hit rate."""
    s = scheduler(params, SPECS["vegas"])
    s.start()
    try:
        client = TestClient(create_app(s, "tiny"))
        usages = [client.post("/v1/completions", json={"model": "tiny", "prompt": r.ids.tolist(), "max_tokens": r.max_new,
                                                       "temperature": 0}).json()["usage"]
                  for r in shared_prefix_requests()[:2]]
        metrics = client.get("/metrics").text
    finally:
        s.stop()
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 2 * PAGE]
    assert 'jaxspec_kv_pages{state="cached"} 2' in metrics and 'jaxspec_kv_pages{state="in_use"} 0' in metrics
    assert f"jaxspec_prefix_cache_hit_rate {2 * PAGE / (4 * PAGE + 30):.4f}" in metrics


NSA_CFG = dataclasses.replace(CFG, model_type="llama-nsa", qk_norm=False,
                              nsa=NSAConfig(block_size=16, block_counts=4, window_size=32))
SCATTERED_CASES = {  # the dense model's methods besides plain and vegas, and an NSA model's
    "stream": (CFG, SpecConfig(method="stream", gamma=3, min_tokens=32)),
    "quest": (CFG, SpecConfig(method="quest", gamma=3, min_tokens=32)),
    "ngram": (CFG, SpecConfig(method="ngram", gamma=3)),
    "vegas tree 3,1+0+1": (CFG, SpecConfig(method="vegas", tree=(3, (1, 0, 1)), min_tokens=32)),  # per-node children
    "nsa plain": (NSA_CFG, SpecConfig(method="plain")),
    "nsa vegas": (NSA_CFG, SpecConfig(method="vegas", gamma=3, min_tokens=32)),
}


def plain_alone(params, cfg, r: Request) -> list[int]:
    """Plain greedy decoding of `r` alone, in a batch's cache (the output every method must reproduce)."""
    eng = engine.Engine(cfg, SpecConfig(method="plain").validate(), GREEDY, MAX_LEN)
    out = jax.jit(eng.generate)(params, jnp.asarray(r.ids[None]), jnp.asarray([len(r.ids)]), jax.random.key(0),
                                max_new_tokens=r.max_new, stop_ids=-jnp.ones((1,), jnp.int32))
    return np.asarray(out.tokens[0, len(r.ids): len(r.ids) + r.max_new]).tolist()


@pytest.mark.parametrize("case", list(SCATTERED_CASES))
def test_every_method_on_scattered_pages_equals_plain_alone(params, case):
    """Each method (and an NSA model) served over a pool whose free pages were shuffled first, so every
    row's pages lie anywhere in it: each request's greedy tokens are plain decoding's of it alone."""
    cfg, spec = SCATTERED_CASES[case]
    model = params if cfg is CFG else decoder.init_params(cfg, jax.random.key(6), scale=0.1)
    s = Scheduler(model, cfg, None, spec.validate(), slots=3, max_len=MAX_LEN, max_top_k=32, kv_pages=13,
                  page_size=PAGE)
    random.Random(case).shuffle(s.pool._free)
    requests = [Request(60 + i, [90, 140, 70][i], [40, 30, 50][i], GREEDY) for i in range(3)]
    tokens, finished, most = serve_all(s, requests)
    assert most == 3
    for i, r in enumerate(requests):
        assert finished[i].finish_reason == "length" and tokens[i] == plain_alone(model, cfg, r), i
    assert_pool_idle(s)


def test_chunked_prefill_from_a_cached_prefix_and_shrinking(params):
    """Chunked prefill (32 positions a round) of prompts whose first pages are cached starts each row at
    its own cached prefix; with `shrink` the state moves into fewer rows and back while requests come
    and go over the shared pool: every output equals the request alone and every admission after the
    first reads the shared prompt's two cached pages."""
    spec = SPECS["vegas"].validate()
    first, longer, again = shared_prefix_requests()
    other = Request(93, 150, 20, GREEDY)
    s = Scheduler(params, CFG, None, spec, slots=4, max_len=MAX_LEN, max_top_k=32, kv_pages=POOL + 4, page_size=PAGE,
                  prefill_chunk=32, shrink=True)
    tokens, finished, _ = serve_all(s, [first])
    later_tokens, later_finished, _ = serve_all(s, [longer, other, again])
    assert s.rows < s.slots  # the last request ran alone in a shrunk state
    assert [later_finished[i].stats.cached_tokens for i in range(3)] == [2 * PAGE, 0, PAGE]
    for out, r in zip([tokens[0], *later_tokens.values()], [first, longer, other, again]):
        assert out == alone(params, spec, r)
    assert_pool_idle(s)


def test_a_failure_in_a_shrunk_state_starts_again_from_every_slot(params):
    """A failure while a paged scheduler runs shrunk fails what ran and starts again from `slots` free
    rows: the next request runs to its tokens alone (the next admission once grew a state it no
    longer had, failing every round)."""
    spec = SpecConfig(method="plain").validate()
    s = Scheduler(params, CFG, None, spec, slots=4, max_len=MAX_LEN, max_top_k=32, kv_pages=13, page_size=64,
                  shrink=True)
    _, finished = submit_all(s, [Request(10 + i, 40, n, GREEDY) for i, n in enumerate([200, 3, 3, 3])])
    while s.rows == s.slots:
        s.step()
    s._fail_all("internal error: the device fell over")  # what the server's loop does on a failed segment
    assert finished[0].finish_reason == "error" and s.rows == s.slots
    late = Request(20, 40, 5, GREEDY)
    tokens, done = submit_all(s, [late])
    for _ in range(10):
        if done:
            break
        s.step()
    assert done[0].finish_reason == "length" and tokens[0] == alone(params, spec, late)
    assert_pool_idle(s)
