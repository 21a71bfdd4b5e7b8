"""The paged KV pool's host allocator (`serving.pages.PagePool`): rows own pages exclusively unless they
share cached prefix pages, the null page is never handed out, unreferenced cached pages are evicted
least recently released first, prefix matches follow the chained keys (whole pages, never the last
prompt token), and a random allocate/match/register/release sequence keeps every invariant and agrees
with a model that keys pages by their whole prefix instead of a hash."""

from __future__ import annotations

import collections
import random

import pytest

from jaxspec.serving.pages import NULL_PAGE, PagePool

P = 4


def check(pool: PagePool, rows=()) -> None:
    """Every allocatable page in exactly one state; refcounts are the rows' holdings; only cached pages
    are shared; keys and pages map one to one."""
    held = collections.Counter(p for row in rows for p in row)
    assert NULL_PAGE not in held and pool.refcount(NULL_PAGE) == 0
    assert all(len(set(row)) == len(row) for row in rows)
    free, evictable = set(pool._free), set(pool._evictable)
    assert len(free) == pool.free and NULL_PAGE not in free | evictable | set(pool._key_of)
    for page in range(1, pool.num_pages):
        assert pool.refcount(page) == held[page]
        assert [held[page] > 0, page in evictable, page in free].count(True) == 1, page
        assert held[page] <= 1 or page in pool._key_of, f"page {page} shared but not cached"
    assert not free & set(pool._key_of) and evictable <= set(pool._key_of)
    assert {k: p for p, k in pool._key_of.items()} == pool._page_of
    assert pool.in_use + pool.cached + pool.free == pool.num_pages - 1 == len(held) + pool.cached + pool.free


def state(pool: PagePool):
    return (list(pool._refs), list(pool._free), list(pool._evictable), dict(pool._key_of), pool.hit_tokens,
            pool.lookup_tokens)


def prompt_row(pool: PagePool, tokens) -> list[int]:
    """A row admitted with `tokens` as its prompt: matched pages, fresh ones after, the prompt registered."""
    pages = pool.match(tokens)
    pages += pool.allocate(pool.pages_for(len(tokens)) - len(pages))
    pool.register(tokens, pages)
    return pages


def test_needs_an_allocatable_page():
    for n in (0, 1):
        with pytest.raises(ValueError, match="allocatable page"):
            PagePool(n, P)
    assert PagePool(2, P).allocate(1) == [1]


def test_allocate_release_refcounts():
    pool = PagePool(6, P)
    a, b = pool.allocate(2), pool.allocate(3)
    assert sorted(a + b) == [1, 2, 3, 4, 5]
    check(pool, [a, b])
    assert pool.allocate(1) is None and pool.allocate(0) == []
    pool.release(a)
    check(pool, [b])
    assert pool.free == 2 and pool.in_use == 3 and pool.cached == 0
    before = state(pool)
    for bad in (a, [NULL_PAGE], b + b[:1]):  # released twice, the null page, more than held
        with pytest.raises(ValueError, match="released more often"):
            pool.release(bad)
        assert state(pool) == before
    c = pool.allocate(2)
    assert sorted(c) == sorted(a)
    check(pool, [b, c])


def test_allocate_none_leaves_pool_unchanged():
    pool = PagePool(8, P)
    row = prompt_row(pool, list(range(10)))  # 3 pages, 2 cached
    keep = pool.allocate(2)
    pool.release(row)
    check(pool, [keep])
    assert (pool.free, pool.cached, pool.available) == (3, 2, 5)
    before = state(pool)
    assert pool.allocate(6) is None
    assert state(pool) == before
    assert len(pool.allocate(5)) == 5 and pool.cached == 0


def test_lru_eviction_order():
    pool = PagePool(5, P)
    prompts = {name: [i] * P for i, name in enumerate("abc")}  # one page each, cached on release
    rows = {name: prompt_row(pool, prompts[name]) for name in "abc"}
    for name in "bac":  # release order: b is the least recently released
        pool.release(rows[name])
    assert pool.cached == 3 and pool.free == 1
    assert pool.allocate(1) == [4]  # the free page first
    assert pool.allocate(1) == rows["b"][:1]
    assert pool.match(prompts["b"] + [0]) == []  # its key went with it
    assert pool.match(prompts["a"] + [0]) == rows["a"]  # referenced again: out of the LRU
    assert pool.allocate(1) == rows["c"]
    assert pool.allocate(1) is None
    check(pool, [[4], rows["b"], rows["a"], rows["c"]])


def test_release_evicts_a_prefix_tail_first():
    pool = PagePool(4, P)
    tokens = list(range(3 * P))
    row = prompt_row(pool, tokens)
    pool.release(row)
    assert pool.allocate(1) == row[2:]
    assert pool.match(tokens + [0]) == row[:2]  # the chain's head is still whole


def test_match_follows_the_chain():
    pool = PagePool(16, P)
    tokens = list(range(3 * P + 2))  # 3 full pages and 2 tokens
    row = prompt_row(pool, tokens)
    assert len(row) == 4 and len(pool._key_of) == 3  # only full pages are keyed
    assert pool.match(tokens) == row[:3]
    assert pool.match(tokens[: 3 * P + 1]) == row[:3]
    assert pool.match(tokens[: 3 * P]) == row[:2]  # the last prompt token is always computed
    assert pool.match(tokens[:P]) == []
    assert pool.match(tokens[: 2 * P - 1] + [99] + tokens[2 * P:]) == row[:1]  # page 1 differs
    assert pool.match([99] + tokens[1:]) == []  # page 0 differs: later pages no longer match
    assert pool.match(tokens[P:]) == []  # page 1's tokens at the start are not page 1
    check(pool, [row] + [row[:3]] * 2 + [row[:2], row[:1]])


def test_register_keeps_the_existing_page():
    pool = PagePool(16, P)
    tokens = list(range(2 * P + 1))
    first = prompt_row(pool, tokens)
    fresh = pool.allocate(3)  # a row that wrote the same prompt before the first registered it
    pool.register(tokens, fresh)
    assert all(p not in pool._key_of for p in fresh)
    pool.register(tokens, first)  # registering again changes nothing
    assert pool._page_of == {k: p for p, k in pool._key_of.items()} and sorted(pool._key_of) == sorted(first[:2])
    pool.release(fresh)
    assert pool.free == 15 - 3 and pool.cached == 0  # unkeyed pages go back to the free list
    check(pool, [first])
    with pytest.raises(ValueError, match="not held"):
        pool.register(tokens, fresh)
    with pytest.raises(ValueError, match="cached for other tokens"):  # a row wrote into a shared page
        pool.register([99] + tokens[1:], first)


def test_register_extends_a_row():
    pool = PagePool(16, P)
    tokens = list(range(P + 1))
    row = prompt_row(pool, tokens)
    tokens += [7] * (2 * P)  # generated tokens written
    row += pool.allocate(pool.pages_for(len(tokens)) - len(row))
    pool.register(tokens, row)
    assert pool.match(tokens + [0]) == row[:3]
    with pytest.raises(ValueError, match="fill 3 pages"):
        pool.register(tokens, row[:2])


def test_shared_page_survives_one_release():
    pool = PagePool(8, P)
    tokens = list(range(2 * P + 1))
    a = prompt_row(pool, tokens)
    b = prompt_row(pool, tokens)
    assert b[:2] == a[:2] and b[2] != a[2]
    check(pool, [a, b])
    pool.release(a)
    assert [pool.refcount(p) for p in b] == [1, 1, 1] and pool.cached == 0
    check(pool, [b])
    pool.release(b)
    assert pool.cached == 2 and pool.in_use == 0
    check(pool)


def test_prefix_cache_off():
    pool = PagePool(8, P, prefix_cache=False)
    tokens = list(range(3 * P))
    row = prompt_row(pool, tokens)
    assert pool._key_of == {} and pool.match(tokens) == []
    pool.release(row)
    assert pool.free == 7 and pool.cached == 0
    assert pool.hit_rate == 0.0 and pool.lookup_tokens == 2 * len(tokens)
    check(pool)


def test_hit_rate():
    pool = PagePool(16, P)
    assert pool.hit_rate == 0.0
    tokens = list(range(3 * P + 1))
    rows = [prompt_row(pool, tokens), prompt_row(pool, tokens[: 2 * P + 2])]
    assert (pool.hit_tokens, pool.lookup_tokens) == (2 * P, 5 * P + 3)
    assert pool.hit_rate == pytest.approx(2 * P / (5 * P + 3))
    check(pool, rows)


def test_pages_for():
    pool = PagePool(4, P)
    assert [pool.pages_for(n) for n in (0, 1, P, P + 1, 3 * P)] == [0, 1, 1, 2, 3]


@pytest.mark.parametrize("seed", range(4))
def test_random_sequence_keeps_invariants(seed):
    """Rows come (matching, allocating, writing and registering their prompts), grow and leave. A model
    keys cached pages by their whole prefix and keeps its own LRU; the pool's matches, evictions and
    counters agree with it, a matched page holds the row's tokens, and no row writes a cached page."""
    rng = random.Random(seed)
    pool = PagePool(24, P)
    bases = [[rng.randrange(3) for _ in range(6 * P)] for _ in range(3)]  # shared prefixes, small vocabulary
    content: dict[int, list] = {}  # page -> the tokens rows wrote into it
    page_of: dict[tuple, int] = {}  # model: cached prefix (whole pages) -> its page
    prefix_of: dict[int, tuple] = {}
    lru: dict[int, None] = {}  # model: unreferenced cached pages, least recently released first
    rows: dict[int, tuple[list[int], list[int]]] = {}  # row -> (tokens, pages)
    hits = lookups = evictions = 0

    def take(n):
        free_before = pool.free
        pages = pool.allocate(n)
        if pages is None:
            return None
        evicted = list(lru)[: max(0, n - free_before)]
        assert sorted(p for p in pages if p in prefix_of) == sorted(evicted)
        for p in evicted:
            del lru[p], page_of[prefix_of.pop(p)]
        nonlocal evictions
        evictions += len(evicted)
        return pages

    def write(tokens, pages, start):
        for pos in range(start, len(tokens)):
            page = pages[pos // P]
            assert pool.refcount(page) == 1 and page not in pool._key_of, "a row writes only its own pages"
            content.setdefault(page, [None] * P)[pos % P] = tokens[pos]

    def register(tokens, pages):
        pool.register(tokens, pages)
        for i in range(len(tokens) // P):
            prefix = tuple(tokens[: (i + 1) * P])
            if pages[i] not in prefix_of and prefix not in page_of:
                page_of[prefix], prefix_of[pages[i]] = pages[i], prefix

    for step in range(400):
        op = rng.random()
        if op < 0.45 or not rows:  # admit a row
            base = rng.choice(bases)
            tokens = base[: rng.randrange(1, len(base))] + [rng.randrange(3) for _ in range(rng.randrange(4))]
            expected = []
            while len(expected) < (len(tokens) - 1) // P and tuple(tokens[: (len(expected) + 1) * P]) in page_of:
                expected.append(page_of[tuple(tokens[: (len(expected) + 1) * P])])
            matched = pool.match(tokens)
            hits, lookups = hits + len(matched) * P, lookups + len(tokens)
            assert matched == expected
            for i, page in enumerate(matched):
                assert content[page] == tokens[i * P:(i + 1) * P]
                lru.pop(page, None)
            fresh = take(pool.pages_for(len(tokens)) - len(matched))
            if fresh is None:  # no room: preempt nobody, give the matched pages back
                pool.release(matched)
                lru.update((p, None) for p in reversed(matched) if pool.refcount(p) == 0)
            else:
                write(tokens, matched + fresh, len(matched) * P)
                register(tokens, matched + fresh)
                rows[step] = (tokens, matched + fresh)
        elif op < 0.75:  # a row grows by a few generated tokens
            tokens, pages = rows[rng.choice(list(rows))]
            grown = tokens + [rng.randrange(3) for _ in range(rng.randrange(1, 2 * P))]
            more = take(pool.pages_for(len(grown)) - len(pages))
            if more is not None:
                pages += more
                write(grown, pages, len(tokens))
                tokens[:] = grown
                register(tokens, pages)
        else:  # a row finishes or is preempted
            tokens, pages = rows.pop(rng.choice(list(rows)))
            pool.release(pages)
            lru.update((p, None) for p in reversed(pages) if p in prefix_of and pool.refcount(p) == 0)
        check(pool, [pages for _, pages in rows.values()])
        assert list(pool._evictable) == list(lru)
        assert {pool._key_of[p]: p for p in prefix_of} == pool._page_of
        assert (pool.hit_tokens, pool.lookup_tokens) == (hits, lookups)
    assert hits and evictions  # the sequence did exercise the cache
