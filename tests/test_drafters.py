"""Each drafter's selection on hand-made cases where the right answer is known (docs/architecture.md, "drafters").

The attended set of a draft step is read off the attention itself: with every key zero the softmax is
uniform over the attended slots, and with value[slot] = one-hot(slot) the output is their indicator
divided by their number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.config import ModelConfig
from jaxspec.decoding.drafters import DraftRows, make_drafter
from jaxspec.decoding.tree import TreeShape
from jaxspec.decoding.drafters.quest import PageBounds
from jaxspec.decoding.drafters.stream import SINKS
from jaxspec.models.kvcache import KVCache
from jaxspec.decoding.spec import PAGE, Budget, SpecConfig
from pallas_kernels import paging
from paged_pools import scatter

S = 256  # cache slots; head_dim = S so that a value can be the one-hot of its slot
CFG = ModelConfig(
    model_type="llama", vocab_size=32, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=S,
    intermediate_size=32, dtype="float32",
)


def drafter(method: str, k_max: int = 64, gamma: int = 4, **kw):
    return make_drafter(SpecConfig(method=method, gamma=gamma, k_max=k_max, **kw), CFG, max_len=S - 32)


POOL_PAGE = 128  # the cache's page size (S = 2 pages a row)
SEED = 61  # one seed: every paged stack of a batch size shares one table (rows' pages scattered)


def paged(stacks, page_size: int) -> KVCache:
    """A cache of contiguous stacks k, v [L, B, Hkv, S, Dh] in poisoned pools, rows' pages scattered."""
    (k, v), pages = scatter(stacks, page_size, SEED)
    return KVCache(k, v, pages, page_size=page_size)


def probe_cache(batch: int) -> KVCache:
    L, H = CFG.num_layers, CFG.num_kv_heads
    k = jnp.zeros((L, batch, H, S, S), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (L, batch, H, S, S))
    return paged((k, v), POOL_PAGE)


def chain_row(q_pos) -> DraftRows:
    """One draft row per sequence at positions (= slots) q_pos [B]."""
    return DraftRows(jnp.asarray(q_pos, jnp.int32), jnp.int32(0), jnp.zeros((1,), jnp.int32),
                     jnp.ones((1, 1), bool), chain=True)


def tree_rows(tree: TreeShape, first, depth: int) -> DraftRows:
    """The nodes of `depth` of `tree` rooted at slots first [B]."""
    rows = tree.rows_at(depth)
    return DraftRows(jnp.asarray(first, jnp.int32), jnp.int32(depth), jnp.asarray(rows),
                     jnp.asarray(tree.ancestors[rows]), chain=tree.is_chain)


def attended(d, state, budget: Budget, rows, layer: int, q=None) -> list[list[set[int]]]:
    """Slots attended by each (sequence, KV head) of draft row 0, read off the output; `rows` are
    the DraftRows, or positions [B] of one chain row each. With DraftRows, a list per row."""
    if not isinstance(rows, DraftRows):
        return [per_row[0] for per_row in attended(d, state, budget, chain_row(rows), layer, q)]
    B, T = rows.slots.shape
    attend, layer_xs = d.attend(state, budget, rows)
    x = jax.tree.map(lambda a: a[layer], layer_xs)
    if q is None:
        q = jnp.ones((B, T, CFG.num_heads, S), jnp.float32)
    # jitted: one compile (eagerly, every op of the attention compiles on its own)
    out = np.asarray(jax.jit(attend)(jnp.int32(layer), q, probe_cache(B), x, None, ())[0])  # [B, T, Hq, S]
    sets = []
    for b in range(B):
        per_row = []
        for t in range(T):
            heads = []
            for h in range(CFG.num_kv_heads):
                row = out[b, t, h * CFG.group_size]
                slots = set(np.flatnonzero(row > 1e-6).tolist())
                np.testing.assert_allclose(row[sorted(slots)], 1.0 / len(slots), rtol=1e-5)
                heads.append(slots)
            per_row.append(heads)
        sets.append(per_row)
    return sets


def test_budget_rule():
    d = drafter("vegas", k_max=128)
    budget = Budget.of(0.1, 16)
    context = jnp.array([1, 10, 100, 160, 500, 1280, 5000])
    # ceil(0.1 * c) clamped to [16, 128], never more than c
    assert d.count(budget, context).tolist() == [1, 10, 16, 16, 50, 128, 128]
    assert d.count(Budget.of(0.5, 1), jnp.array([3, 7])).tolist() == [2, 4]


def test_shared_budget_follows_lost_drafts():
    """Shares follow each row's lost drafts per iteration (with the prior), are clipped to [1/b, b],
    average 1 over the unfinished rows (the selection's total is unchanged), and ignore finished rows."""
    rng = np.random.default_rng(93)
    iterations = jnp.asarray(rng.integers(20, 60, 6), jnp.int32)
    lost = jnp.asarray(rng.integers(0, 20, 6), jnp.int32).at[2].set(2 * iterations[2])  # row 2: far above the others
    live = jnp.array([True, True, True, True, True, False])
    ratio = float(rng.uniform(0.02, 0.2))
    budget = Budget.of(ratio, 16)
    assert budget.shared(lost, iterations, live, 1.0) is budget
    shared = np.asarray(budget.shared(lost, iterations, live, 2.0).ratio, np.float64)
    rate = (np.asarray(lost, np.float64) + 4) / (np.asarray(iterations) + 4)
    share = np.clip(rate / rate[:5].mean(), 0.5, 2.0)
    np.testing.assert_allclose(shared, ratio * share / share[:5].mean(), rtol=1e-5)
    np.testing.assert_allclose(shared[:5].mean(), ratio, rtol=1e-5)
    assert shared[2] == shared.max() and shared[2] / shared.min() <= 4 * (1 + 1e-5)
    finished_differs = budget.shared(lost.at[5].set(0), iterations, live, 2.0).ratio
    np.testing.assert_allclose(np.asarray(finished_differs)[:5], shared[:5], rtol=1e-6)
    fresh = budget.shared(jnp.zeros(6, jnp.int32), jnp.zeros(6, jnp.int32), live, 4.0)
    np.testing.assert_allclose(np.asarray(fresh.ratio), ratio, rtol=1e-6)


def test_capacity():
    assert SpecConfig(ratio=0.07, min_tokens=256, balance=2.0).capacity(8192) == 1152  # room for twice the even share
    assert SpecConfig(ratio=0.07, min_tokens=256).capacity(8192) == 576  # ceil(573.44) -> multiple of 16
    assert SpecConfig(ratio=0.07, min_tokens=256).capacity(1000) == 256
    assert SpecConfig(ratio=0.5, min_tokens=16).capacity(100) == 64  # 50 rounded up to a page
    assert SpecConfig(k_max=48).capacity(10**6) == 48


def test_vegas_selects_top_scores_then_attends_selection_and_tail():
    d = drafter("vegas", k_max=32)
    rng = np.random.default_rng(0)
    L, B = CFG.num_layers, 2
    last = np.array([150, 40])
    scores = np.where(np.arange(S) <= last[None, :, None], rng.normal(size=(L, B, S)), -np.inf).astype(np.float32)
    budget = Budget.of(0.1, 8)
    state = d.after_verify(d.init(probe_cache(B), None), budget, jnp.asarray(scores), None, jnp.asarray(last), None, None)
    k = np.array([16, 8])  # ceil(0.1 * 151) = 16; ceil(0.1 * 41) = 5 -> min_tokens 8
    assert np.asarray(state.n_idx).tolist() == k.tolist()
    assert np.asarray(state.tail_start).tolist() == (last + 1).tolist()
    q_pos = last + 5
    for layer in range(L):
        sets = attended(d, state, budget, q_pos, layer)
        for b in range(B):
            top = set(np.argsort(-scores[layer, b])[: k[b]].tolist())
            expected = top | set(range(last[b] + 1, q_pos[b] + 1))
            assert sets[b][0] == sets[b][1] == expected  # one selection shared by the KV heads


def test_vegas_short_context_selects_everything():
    d = drafter("vegas", k_max=64)
    last = np.array([20])
    scores = np.where(np.arange(S) <= 20, 1.0, -np.inf).astype(np.float32)[None, None].repeat(CFG.num_layers, 0)
    budget = Budget.of(0.07, 32)
    state = d.after_verify(d.init(probe_cache(1), None), budget, jnp.asarray(scores), None, jnp.asarray(last), None, None)
    assert int(state.n_idx[0]) == 21
    assert attended(d, state, budget, np.array([23]), layer=1)[0][0] == set(range(24))


@pytest.mark.parametrize("method, rows", [("vegas", (0, 6)), ("all_rows", tuple(range(7)))])
def test_collected_rows(method, rows):
    collect = drafter(method, gamma=6).collect(7)
    assert collect.rows == rows and collect.reduce_rows
    assert drafter(method, metric="logit").collect(5).metric == "logit"
    assert drafter(method).collect(1).rows == (0,)  # the last prompt token after prefill


def test_last_accepted_uses_the_row_of_the_last_accepted_token():
    d = drafter("last_accepted", k_max=16)
    collect = d.collect(5)
    assert collect.rows == tuple(range(5)) and not collect.reduce_rows
    L, B, R = CFG.num_layers, 2, 5
    first = np.array([100, 30])
    accepted = np.array([3, 0])
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(L, B, R, S)).astype(np.float32)
    scores = np.where(np.arange(S) <= (first[None, :, None, None] + np.arange(R)[None, None, :, None]), scores, -np.inf)
    budget = Budget.of(0.05, 16)
    chain = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32), (B, R))
    state = d.after_verify(d.init(probe_cache(B), None), budget, jnp.asarray(scores, jnp.float32), None,
                           jnp.asarray(first), jnp.asarray(accepted), chain)
    last = first + accepted
    assert np.asarray(state.tail_start).tolist() == (last + 1).tolist()
    for b in range(B):
        expected = set(np.argsort(-scores[2, b, accepted[b]])[:16].tolist())
        assert set(np.asarray(state.idx)[2, b, 0, :16].tolist()) == expected


def test_stream_sinks_and_page_aligned_window():
    d = drafter("stream", k_max=96)
    budget = Budget.of(0.25, 48)
    q_pos = np.array([200, 40, 70])
    sets = attended(d, None, budget, q_pos, layer=0)
    # context 201: K = ceil(50.25) = 51 -> 16 sinks + a window of <= 35 slots starting on a page: [176, 200]
    assert sets[0][0] == set(range(SINKS)) | set(range(176, 201))
    # context 41 <= K = 48: dense
    assert sets[1][0] == set(range(41))
    # context 71: K = 48 -> window of <= 32 from a page boundary: [48, 70]
    assert sets[2][0] == set(range(SINKS)) | set(range(48, 71))
    assert sets[0][0] == sets[0][1]


def test_quest_picks_top_pages_per_kv_head_plus_own_page_and_dense_first_layers():
    d = drafter("quest", k_max=64)
    L, B, H, P = CFG.num_layers, 1, CFG.num_kv_heads, S // PAGE
    rng = np.random.default_rng(2)
    page_value = rng.permutation(P * H).reshape(H, P).astype(np.float32)  # distinct scores per head
    # With q = ones, a page's score is (group size) * sum_d kmax_d: a page's value spread over head_dim.
    kmax = jnp.asarray(np.broadcast_to(page_value[None, None, :, :, None] / S, (L, B, H, P, S)), jnp.float32)
    (kmin, kmax), pages = scatter((kmax - 1.0, kmax), POOL_PAGE // PAGE, SEED)  # the bounds' pools
    np.testing.assert_array_equal(np.asarray(pages), np.asarray(probe_cache(B).pages))  # under the cache's table
    state = PageBounds(kmin, kmax)
    q_pos = np.array([150])  # own page 9 = slots [144, 150]
    budget = Budget.of(0.3, 16)  # K = ceil(45.3) = 46 -> ceil(46 / 16) - 1 = 2 earlier pages + own page
    sparse = attended(d, state, budget, q_pos, layer=2)
    for h in range(H):
        top = np.argsort(-page_value[h, :9])[:2]
        expected = {int(p) * PAGE + i for p in top for i in range(PAGE)} | set(range(144, 151))
        assert sparse[0][h] == expected
    assert sparse[0][0] != sparse[0][1]
    assert attended(d, state, budget, q_pos, layer=1)[0][0] == set(range(151))  # dense layers


def test_quest_page_bounds_follow_the_cache():
    d = drafter("quest", k_max=64)
    rng = np.random.default_rng(3)
    shape = (CFG.num_layers, 2, CFG.num_kv_heads, S, 8)
    k = rng.normal(size=shape).astype(np.float32)
    cache = paged((jnp.asarray(k), jnp.zeros(shape, jnp.float32)), POOL_PAGE)
    rows = lambda bounds: np.asarray(paging.logical_view(bounds, cache.pages, POOL_PAGE // PAGE))  # per row's pages
    state = d.init(cache, None)
    pages = k.reshape(*shape[:3], S // PAGE, PAGE, 8)
    np.testing.assert_array_equal(rows(state.kmax), pages.max(axis=4))
    new_k = k.copy()
    new_k[:, 0, :, 37] += 5.0
    new_k[:, 1, :, 200] -= 5.0
    cache = paged((jnp.asarray(new_k), jnp.zeros(shape, jnp.float32)), POOL_PAGE)  # the same table
    state = d.after_draft_step(state, cache, jnp.array([[37], [200]]))
    pages = new_k.reshape(*shape[:3], S // PAGE, PAGE, 8)
    np.testing.assert_array_equal(rows(state.kmax), pages.max(axis=4))
    np.testing.assert_array_equal(rows(state.kmin), pages.min(axis=4))


def test_ngram_continues_the_longest_most_recent_match():
    d = drafter("ngram", gamma=3, ngram_min=1, ngram_max=3)
    tokens = np.zeros((4, 16), np.int32)
    rows = [
        ([5, 6, 7, 8, 9, 5, 6, 7], [8, 9, 5]),  # "5 6 7" seen before: continue with what followed
        ([1, 2, 9, 1, 3, 4, 1, 2], [9, 1, 3]),  # longest match "1 2" beats the later "1"
        ([4, 2, 5, 4, 3, 6, 7, 4], [3, 6, 7]),  # only "4" matches: its most recent occurrence
        ([1, 2, 3, 4], [4, 4, 4]),  # no match: repeat the last token
    ]
    lengths = []
    for b, (seq, _) in enumerate(rows):
        tokens[b, : len(seq)] = seq
        tokens[b, len(seq) :] = 99  # beyond the length: never proposed
        lengths.append(len(seq))
    # jitted: one compile (eagerly ~2 s, every op compiling on its own)
    drafts = np.asarray(jax.jit(d.propose, static_argnums=2)(jnp.asarray(tokens), jnp.asarray(lengths), TreeShape.chain(3)))
    assert drafts[:, 1:].tolist() == [expected for _, expected in rows]
    assert drafts[:, 0].tolist() == [seq[-1] for seq, _ in rows]  # row 0: the pending token


def test_ngram_chain_continues_the_best_of_the_tree_matches():
    """A chain's one match (an argmax) is the first of the ranked matches a tree takes (a top-k), on
    fresh repetitive rows of random lengths, rows without any match included."""
    d = drafter("ngram", gamma=4, ngram_min=1, ngram_max=3)
    rng = np.random.default_rng(254)
    tokens = rng.integers(0, 3, size=(16, 64)).astype(np.int32)  # 3 tokens: every row of 24 or more matches
    tokens[0, :10] = np.arange(10)  # no earlier occurrence of anything: no match
    lengths = jnp.asarray(np.r_[10, rng.integers(24, 65, size=15)], jnp.int32)
    continuations = jax.jit(d.continuations, static_argnums=(2, 3))  # eagerly, every op compiles on its own
    one, found_one = continuations(jnp.asarray(tokens), lengths, 1, 4)
    many, found_many = continuations(jnp.asarray(tokens), lengths, 8, 4)
    np.testing.assert_array_equal(np.asarray(found_one), np.asarray(found_many)[:, :1])
    assert not bool(found_one[0, 0]) and bool(np.asarray(found_one)[1:].all())
    np.testing.assert_array_equal(np.asarray(one)[1:], np.asarray(many)[1:, :1])


@pytest.mark.parametrize("gamma, ngram_min, ngram_max", [(4, 1, 4), (2, 2, 3), (7, 1, 1)])
def test_ngram_replay_walks_the_chains_propose_drafts(gamma, ngram_min, ngram_max):
    """`replay` (every position's chain at once, by sorting n-grams) takes the iterations of a walk
    that calls `propose` at each length and accepts its drafts while they equal the text: on fresh
    rows of few tokens (many matches), some repeating a period with noise, windows from anywhere
    to anywhere (empty ones included) and buffer slots past `end` poisoned."""
    d = drafter("ngram", gamma=gamma, ngram_min=ngram_min, ngram_max=ngram_max)
    rng = np.random.default_rng()
    B, N = 6, 96
    tokens = rng.integers(0, 4, size=(B, N)).astype(np.int32)
    for b in range(0, B, 2):
        period = int(rng.integers(2, 9))
        tokens[b] = np.tile(tokens[b, :period], N // period + 1)[:N]
        tokens[b, rng.random(N) < 0.1] = 3
    start = rng.integers(1, N, size=B).astype(np.int32)
    end = np.minimum(start + rng.integers(0, N, size=B), N - 4).astype(np.int32)
    end[0], start[1], start[2] = start[0], N - 4, 1  # an empty window; one from past its end; one from the start
    tokens[np.arange(N)[None, :] >= end[:, None] + gamma] = -7  # past every draft's reach: never read
    propose = jax.jit(lambda t, length: d.propose(t, length, TreeShape.chain(gamma))[:, 1:])
    drafts = np.stack([np.asarray(propose(jnp.asarray(tokens), jnp.full((B,), p, jnp.int32))) for p in range(N)],
                      axis=1)  # [B, length, gamma]
    expected = []
    for b in range(B):
        length, iterations = int(start[b]), 0
        while length < end[b]:
            accepted = 0
            while (accepted < gamma and length + accepted < end[b]
                   and drafts[b, length, accepted] == tokens[b, length + accepted]):
                accepted += 1
            length, iterations = length + accepted + 1, iterations + 1
        expected.append(iterations)
    got = np.asarray(jax.jit(d.replay)(jnp.asarray(tokens), jnp.asarray(start), jnp.asarray(end)))
    assert got.tolist() == expected
    assert expected[0] == expected[1] == 0 and max(expected) > 5


# --- draft trees: the nodes of one depth draft together, each seeing its own ancestors -------------

TREE = TreeShape((2, 2), "dfs")  # rows: 0 root; 1 (kids 2, 3); 4 (kids 5, 6)


def ancestor_slots(first: int, row: int) -> set[int]:
    return {first + int(r) for r in np.flatnonzero(TREE.ancestors[row])}


@pytest.mark.parametrize("method", ["vegas", "stream", "quest"])
def test_tree_nodes_attend_the_selection_the_committed_tail_and_their_ancestors(method):
    """The 4 nodes of depth 2 (rows 2, 3, 5, 6 at slots first + row) share the policy's selection and
    committed tail, and of the tree's slots each sees only itself, its parent and the root."""
    d = drafter(method, k_max=32, tree=(2, 2), traversal="dfs")
    L, B, last = CFG.num_layers, 2, np.array([150, 100])
    first = last + np.array([3, 1])  # roots after 2 and 0 accepted drafts
    budget = Budget.of(0.1, 8)
    rng = np.random.default_rng(4)
    scores = np.where(np.arange(S) <= last[None, :, None], rng.normal(size=(L, B, S)), -np.inf).astype(np.float32)
    state = None
    if method == "vegas":
        state = d.after_verify(d.init(probe_cache(B), None), budget, jnp.asarray(scores), None, jnp.asarray(last), None, None)
    if method == "quest":
        state = d.init(probe_cache(B), None)
    rows = tree_rows(TREE, first, depth=2)
    chain = attended(d, state, budget, first + 2, layer=2)  # a chain row at the same position
    sets = attended(d, state, budget, rows, layer=2)
    for b in range(B):
        committed = {s for s in chain[b][0] if s < first[b]}
        assert len(committed) < first[b]  # sparse
        for t, row in enumerate(TREE.rows_at(2)):
            assert sets[b][t][0] == committed | ancestor_slots(first[b], row)


def test_last_accepted_moves_its_scores_with_the_accepted_path():
    """Tree (2, 1) BFS: rows 1, 2 (depth 1), 3 under 1, 4 under 2. Path 0 -> 2 -> 4 accepted: the
    scores of row 4 at slots first + 2 and first + 4 move to first + 1 and first + 2 with their keys."""
    d = drafter("last_accepted", k_max=16, tree=(2, 1))
    L, B, R, first = CFG.num_layers, 1, 5, 60
    scores = np.random.default_rng(5).normal(size=(L, B, R, S)).astype(np.float32)
    scores[:, :, 4, first + 2], scores[:, :, 4, first + 4] = 100.0, 99.0
    scores = np.where(np.arange(S) <= first + np.arange(R)[None, None, :, None], scores, -np.inf)
    path = jnp.asarray([[0, 2, 4]], jnp.int32)
    state = d.after_verify(d.init(probe_cache(B), None), Budget.of(0.05, 16), jnp.asarray(scores), None,
                           jnp.asarray([first]), jnp.asarray([2]), path)
    moved = scores[2, 0, 4, : first + 3].copy()
    moved[first + 1], moved[first + 2] = 100.0, 99.0
    assert set(np.asarray(state.idx)[2, 0, 0].tolist()) == set(np.argsort(-moved)[:16].tolist())
    assert int(state.tail_start[0]) == first + 3


def test_ngram_tree_branches_over_distinct_earlier_continuations():
    """Suffix "1 2" occurred three times, followed by 3 4 (latest), 5 6 and 3 7. Tree (2, 2) BFS: the
    root's children are 3 and 5; under 3 come 4 and 7; under 5 only 6, repeated."""
    d = drafter("ngram", tree=(2, 2), ngram_min=1, ngram_max=3)
    seq = [1, 2, 3, 7, 9, 1, 2, 5, 6, 8, 1, 2, 3, 4, 0, 1, 2]
    tokens = np.full((1, 24), 99, np.int32)
    tokens[0, : len(seq)] = seq
    drafts = np.asarray(jax.jit(d.propose, static_argnums=2)(jnp.asarray(tokens), jnp.asarray([len(seq)]), TreeShape((2, 2))))
    assert drafts.tolist() == [[2, 3, 5, 4, 7, 6, 6]]
