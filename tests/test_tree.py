"""Draft trees (docs/architecture.md, "draft trees"): static layouts, and tree acceptance that keeps the target's
distribution exactly (chi-square of the first three emitted tokens against the exact joint, with
drafted and one-hot candidates, BFS and DFS, a draft distribution with fewer tokens than children),
and follows the argmax when greedy (a chain: the accepted prefix). The chain's speculative-sampling
behaviour is pinned down in test_rejection.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decoding.sampling import top_indices
from jaxspec.decoding.sampling import (RowSampling, SamplingConfig, draw, greedy_rows, process_logits, row_keys,
                                      split_rows, uniform_rows)
from jaxspec.decoding.tree import TreeShape, tree_accept
from jaxspec.errors import JaxspecError

SAMPLE = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig()


def test_layouts():
    bfs, dfs = TreeShape((2, 2)), TreeShape((2, 2), "dfs")
    assert bfs.rows == dfs.rows == 7 and TreeShape.parse("4,2,1,1").rows == 1 + 4 + 8 + 8 + 8
    np.testing.assert_array_equal(bfs.parent, [-1, 0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(bfs.node_depth, [0, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(dfs.parent, [-1, 0, 1, 1, 0, 4, 4])
    np.testing.assert_array_equal(dfs.node_depth, [0, 1, 2, 2, 1, 2, 2])
    np.testing.assert_array_equal(dfs.children[:2], [[1, 4], [2, 3]])
    assert dfs.ancestors[6].tolist() == [True, False, False, False, True, False, True]
    for tree in (bfs, dfs, TreeShape((3, 1, 2), "dfs"), TreeShape.parse("3,2+0+1,1+2", "dfs")):
        for row in range(tree.rows):  # ancestors = the parent chain, each row's depth = its chain length
            chain, r = {row}, row
            while tree.parent[r] >= 0:
                r = tree.parent[r]
                chain.add(r)
            assert set(np.flatnonzero(tree.ancestors[row])) == chain
            assert tree.node_depth[row] == len(chain) - 1


def test_each_node_its_own_children():
    """5,3+1: the root's first child has 3 children, its second 1, the other three none; BFS and DFS keep
    siblings in rank order; a drafter runs the nodes that have children, and a scatter drops the
    missing ones; the text reads back as the same tree (a one-node count keeps its '+')."""
    bfs, dfs = TreeShape.parse("5,3+1"), TreeShape.parse("5,3+1", "dfs")
    assert bfs.branching == (5, (3, 1)) and bfs.rows == dfs.rows == 10 and bfs.widths == (5, 3)
    np.testing.assert_array_equal(bfs.parent, [-1, 0, 0, 0, 0, 0, 1, 1, 1, 2])
    np.testing.assert_array_equal(dfs.parent, [-1, 0, 1, 1, 1, 0, 5, 0, 0, 0])
    np.testing.assert_array_equal(bfs.parents_at(1), [1, 2])
    np.testing.assert_array_equal(bfs.kids(bfs.parents_at(1)), [[6, 7, 8], [9, 10, 10]])
    np.testing.assert_array_equal(dfs.kids(dfs.parents_at(1)), [[2, 3, 4], [6, 10, 10]])
    assert [len(bfs.parents_at(d)) for d in range(2)] == [1, 2] and not bfs.is_chain
    for text in ("5,3+1", "2,1+0,1", "3,2,1", "2,2+0,0+1"):
        tree = TreeShape.parse(text)
        assert TreeShape.parse(tree.text) == tree and tree.text == text
    assert TreeShape.parse("2,1+0,1").branching != TreeShape.parse("2,1,1").branching
    # one tree, one name: a count for every node, all equal, is that number (one compile, one table entry)
    assert TreeShape.parse("3,2+2+2") == TreeShape.parse("3,2") and TreeShape.parse("3,2+2+2").text == "3,2"
    assert TreeShape.parse("1,1+0") == TreeShape.chain(2) and TreeShape((1, [1])) == TreeShape.chain(2)


@pytest.mark.parametrize("text", ["4,0", "a,b", "8,8", "", "3,2+2+2+2", "2,0+0", "2,1+-1", "2,1+", "1000,1000,1000,1000"])
def test_bad_shapes_are_one_line_errors(text):
    with pytest.raises(JaxspecError):
        TreeShape.parse(text)


def random_problem(rng, tree: TreeShape, batch: int, V: int, one_hot: bool, support: int | None = None):
    """Targets and draft distributions that depend only on each row's token path (as a model's do),
    children drawn without replacement from the parent's q (Gumbel top-k), or deterministic distinct
    candidates when one_hot; q keeps `support` tokens when given (fewer than the children: the last
    siblings are drawn from outside it, as the engine's Gumbel top-b pads them). Returns tokens, draft
    probs (or None), target logits and the path tables."""
    D = tree.depth
    target_tables = [rng.normal(size=(V,) * (d + 1)) * 1.5 for d in range(D + 1)]  # logits given a path of d tokens
    draft_logits = [rng.normal(size=(V,) * (d + 1)) * 1.5 for d in range(D)]
    if support is not None:
        draft_logits = [np.where(np.argsort(np.argsort(-t, -1), -1) < support, t, -np.inf) for t in draft_logits]
    draft_tables = [np.exp(t) / np.exp(t).sum(-1, keepdims=True) for t in draft_logits]
    tokens = np.zeros((batch, tree.rows), np.int32)
    paths = [np.zeros((batch, 0), np.int32)] + [None] * (tree.rows - 1)
    logits = np.zeros((batch, tree.rows, V), np.float32)
    probs = np.zeros((batch, tree.rows, V), np.float32)
    for row in range(tree.rows):  # parents precede children in either order
        path = paths[row]
        logits[:, row] = at_paths(target_tables, path)
        kids = tree.children[row][tree.children[row] >= 0]
        if not len(kids):
            continue
        q = at_paths(draft_tables, path)
        probs[:, row] = q
        with np.errstate(divide="ignore"):
            scores = np.log(q) + (0.0 if one_hot else rng.gumbel(size=q.shape))
        order = np.argsort(-scores, axis=1)[:, : len(kids)]
        for i, kid in enumerate(kids):
            tokens[:, kid] = order[:, i]
            paths[kid] = np.concatenate([path, order[:, i : i + 1]], axis=1)
    return tokens, (None if one_hot else probs), logits, target_tables


def shape_sum(shape) -> int:
    """A seed from a branching (per-node counts summed)."""
    return sum(b if isinstance(b, int) else sum(b) for b in shape)


def at_paths(tables, paths):
    """tables[d][path] for paths [n, d] of d tokens: [n, V]."""
    return np.broadcast_to(tables[paths.shape[1]][tuple(paths.T)], (paths.shape[0], tables[0].shape[-1]))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("shape,order,one_hot,support", [
    ((3, 2), "bfs", False, None), ((2, 2), "dfs", False, None), ((1, 1), "bfs", False, None), ((3, 2), "dfs", True, None),
    ((3, 3), "bfs", False, 2), ((3, (2, 0, 1), 1), "dfs", False, None), ((3, (1, 0, 2)), "bfs", True, None),
])
def test_emitted_tokens_follow_the_target(shape, order, one_hot, support):
    """The first three tokens (completed by direct draws from the target where the tree stopped)
    follow p(x1) p(x2 | x1) p(x3 | x1 x2): chi-square over V^3 = 64 cells, 30,000 rows."""
    rng = np.random.default_rng(shape_sum(shape) + len(order) + one_hot)
    tree, V, rows = TreeShape(shape, order), 4, 30000
    tokens, probs, logits, tables = random_problem(rng, tree, rows, V, one_hot, support)
    num, path, emitted = jax.device_get(tree_accept(
        jax.random.key(int(rng.integers(1 << 30))), tree, jnp.asarray(tokens),
        None if probs is None else jnp.asarray(probs), jnp.asarray(logits), SAMPLE))
    assert num.max() == tree.depth and num.min() == 0
    # The accepted path's rows hold the emitted drafts.
    assert all((tokens[np.arange(rows), path[:, d + 1]] == emitted[:, d])[num > d].all() for d in range(tree.depth))
    seq = np.zeros((rows, 3), np.int64)
    for j in range(3):
        have = num >= j if j <= tree.depth else np.zeros(rows, bool)
        seq[have, j] = emitted[have, j]
        p = softmax(at_paths(tables, seq[~have, :j]))
        seq[~have, j] = (p.cumsum(-1) > rng.random((p.shape[0], 1))).argmax(-1)
    counts = np.bincount(seq @ np.array([V * V, V, 1]), minlength=V**3)
    p1 = softmax(tables[0])
    p2 = softmax(tables[1])
    p3 = softmax(tables[2])
    expected = (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1) * rows
    keep = expected >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("b", [1, 3, 5, 6])
def test_a_nodes_children_are_its_top_scores(b):
    """A node's b children (sampling.expand) are its b largest scores, largest first, a tie going to the
    lower index: repeated argmax up to ARGMAX_PICKS, a top-k beyond; against a stable numpy sort. A
    sampled node's scores are -inf outside its nucleus, often for all but one or two tokens: the
    children are still distinct, the -inf ones lowest index first."""
    rng = np.random.default_rng()
    # many ties; + 0.0 turns rounding's -0.0 into 0.0: top-k orders -0.0 below 0.0, the sort ties them
    x = np.round(rng.normal(size=(4, 3, 50)), 1).astype(np.float32) + np.float32(0.0)
    x[rng.random(x.shape) < 0.5] = -np.inf
    x[0, 0, 1:] = -np.inf  # one finite score
    want = np.argsort(-x, axis=-1, kind="stable")[..., :b]
    got = np.asarray(top_indices(jnp.asarray(x), b))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_greedy_follows_the_argmax(order):
    """Greedy: the emitted tokens are the target argmax along the path; the path goes through the
    child holding it; a chain gives exactly the chain's greedy result."""
    rng = np.random.default_rng(7)
    tree, V, rows = TreeShape((3, 2, 1), order), 5, 2000
    tokens, _, logits, _ = random_problem(rng, tree, rows, V, one_hot=True)
    num, path, emitted = jax.device_get(tree_accept(jax.random.key(0), tree, jnp.asarray(tokens), None,
                                                    jnp.asarray(logits), GREEDY))
    argmax = logits.argmax(-1)
    for b in range(rows):
        for d in range(num[b] + 1):
            assert emitted[b, d] == argmax[b, path[b, d]]
        node = path[b, num[b]]
        kids = tree.children[node][tree.children[node] >= 0]
        assert num[b] == tree.depth or argmax[b, node] not in tokens[b, kids]
    assert 0 < num.mean() < tree.depth

    chain = TreeShape.chain(4)  # the accepted prefix of drafts equal to the argmax, then the argmax
    tokens, _, logits, _ = random_problem(rng, chain, rows, V, one_hot=True)
    num, path, emitted = jax.device_get(tree_accept(jax.random.key(0), chain, jnp.asarray(tokens), None,
                                                    jnp.asarray(logits), GREEDY))
    argmax = logits.argmax(-1)
    prefix = np.cumprod(tokens[:, 1:] == argmax[:, :-1], axis=1).sum(axis=1)
    np.testing.assert_array_equal(num, prefix)
    for b in range(rows):
        np.testing.assert_array_equal(emitted[b, : num[b] + 1], argmax[b, : num[b] + 1])
        np.testing.assert_array_equal(path[b, : num[b] + 1], np.arange(num[b] + 1))


@pytest.mark.parametrize("order", ["bfs", pytest.param("dfs", marks=pytest.mark.slow)])  # dfs: slow (20 minutes)
def test_row_rules_accept_as_each_rows_config(order):
    """Row rules (a server's mixed batch): sampled rows accept exactly as their shared config does
    under the same keys, and greedy rows, whose drafts come with the sampled rows' q, follow the
    argmax as a greedy config does, trying every child."""
    rng = np.random.default_rng(12)
    tree, V, rows = TreeShape((3, 2, 1), order), 5, 600
    tokens, probs, logits, _ = random_problem(rng, tree, rows, V, one_hot=False)
    keys = jax.random.split(jax.random.key(4), rows)
    args = (tree, jnp.asarray(tokens), jnp.asarray(probs), jnp.asarray(logits))
    sampled = jax.device_get(tree_accept(keys, *args, SAMPLE))
    greedy = jax.device_get(tree_accept(keys, *args, GREEDY))
    is_greedy = np.arange(rows) % 3 == 0
    mixed_rules = RowSampling.of([GREEDY if g else SAMPLE for g in is_greedy], max_top_k=0)
    mixed = jax.device_get(tree_accept(keys, *args, mixed_rules))
    for got, want_sampled, want_greedy in zip(mixed, sampled, greedy):
        np.testing.assert_array_equal(got[~is_greedy], want_sampled[~is_greedy])
    num, path, emitted = mixed
    np.testing.assert_array_equal(num[is_greedy], greedy[0][is_greedy])
    for b in np.flatnonzero(is_greedy):  # path and tokens up to the accepted length
        np.testing.assert_array_equal(path[b, : num[b] + 1], greedy[1][b, : num[b] + 1])
        np.testing.assert_array_equal(emitted[b, : num[b] + 1], greedy[2][b, : num[b] + 1])
    assert num[is_greedy].max() > 0 and num[~is_greedy].max() > 0


def textbook_accept(key, tree, tokens, draft_probs, target_logits, cfg):
    """The recursion of the module docstring, level by level with whole distributions: r = p at the
    node, each child tested against r, r <- norm(max(r - q_i, 0)) after each rejection, and a draw
    from r (or the leaf's p). Same key use as tree_accept, so the two agree token for token."""
    B, V = tokens.shape[0], target_logits.shape[-1]
    rows = jnp.arange(B)
    draw_key, uniform_key = split_rows(row_keys(key, B), 2)
    u = uniform_rows(uniform_key, (tree.depth, tree.max_branching))
    greedy = jnp.broadcast_to(greedy_rows(cfg, 2), (B, 1))
    cur, alive = jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool)
    num, emitted, final = jnp.zeros((B,), jnp.int32), jnp.zeros((B, tree.depth + 1), jnp.int32), None
    for d in range(tree.depth):
        r = process_logits(target_logits[rows, cur], cfg)
        q = None if draft_probs is None else draft_probs[rows, cur]
        kids, chosen = jnp.asarray(tree.children)[cur], jnp.full((B,), -1, jnp.int32)
        for i in range(tree.max_branching):
            x = tokens[rows, jnp.maximum(kids[:, i], 0)]
            q_i, trying = jax.nn.one_hot(x, V), alive & (chosen < 0) & (kids[:, i] >= 0)
            if q is not None:
                mass = q.sum(-1, keepdims=True)
                q_i, trying = jnp.where(greedy, q_i, q / jnp.maximum(mass, 1e-30)), trying & ((mass[:, 0] > 0) | greedy[:, 0])
            accept = trying & (u[:, d, i] * q_i[rows, x] < r[rows, x])
            chosen, rejected = jnp.where(accept, kids[:, i], chosen), trying & ~accept
            new = jnp.maximum(r - q_i, 0.0)
            mass = new.sum(-1, keepdims=True)
            r = jnp.where(rejected[:, None] & (mass > 0), new / jnp.where(mass > 0, mass, 1.0), r)
            if q is not None:
                q = jnp.where(rejected[:, None] & (jnp.arange(V) == x[:, None]), 0.0, q)
        final = jnp.where((alive & (chosen < 0))[:, None], r, 0.0 if final is None else final)
        step = alive & (chosen >= 0)
        emitted = emitted.at[:, d].set(tokens[rows, jnp.maximum(chosen, 0)])
        cur, num, alive = jnp.where(step, chosen, cur), num + step, step
    final = jnp.where(alive[:, None], process_logits(target_logits[rows, cur], cfg), final)
    return num, jnp.where(jnp.arange(tree.depth + 1) == num[:, None], draw(draw_key, final)[:, None], emitted)


@pytest.mark.parametrize("shape, one_hot, rules", [  # (3, 1, 2, 1): slow, (1, 2, 1) branches (20 minutes)
    ((1, 1, 1, 1), False, "top_p"), ((1, 1, 1), True, "unit"),
    pytest.param((3, 1, 2, 1), False, "top_p", marks=pytest.mark.slow),
    ((1, 2, 1), False, "mixed"), ((2, 1), True, "mixed"), ((3, 2), True, "top_p"), ((2, 3, 1), True, "mixed"),
    ((3, 2), True, "repeats"), ((3, (1, 0, 1), 2), False, "top_p"), ((3, (2, 0, 1), (1, 0, 1)), True, "mixed"),
    ((4, 2), False, "support"), ((5, 3), False, "unit"),
])
def test_acceptance_equals_the_textbook_recursion(shape, one_hot, rules):
    """tree_accept tests a level of one drafted child, or of one-hot candidates, at their tokens only
    and forms the residual where a row stopped once, at the end; token for token it equals the
    whole-distribution recursion, for chains and for trees mixing one-child levels with siblings,
    drafted and one-hot candidates (also one-hot siblings repeating a token, as ngram's do where its
    matches run out), a top-p cutoff, a server's mixed greedy / sampled rows, and q whose support (2 tokens)
    runs out before a node's children do."""
    rng = np.random.default_rng(shape_sum(shape) + 10 * one_hot)
    tree, V, rows = TreeShape(shape), 6, 3000
    support = 2 if rules == "support" else None
    tokens, probs, logits, _ = random_problem(rng, tree, rows, V, one_hot=False, support=support)
    probs = None if one_hot else probs  # one-hot candidates: q is the drafted token's one-hot
    if rules == "repeats":  # in half the rows every node's second candidate repeats its first
        kids = tree.children[tree.children[:, 1] >= 0]
        tokens[::2, kids[:, 1]] = tokens[::2, kids[:, 0]]
    cfg = {"unit": SAMPLE, "top_p": SamplingConfig(temperature=0.8, top_p=0.9), "repeats": SAMPLE, "support": SAMPLE,
           "mixed": RowSampling.of([GREEDY if b % 4 == 0 else SAMPLE for b in range(rows)], max_top_k=0)}[rules]
    args = (jax.random.split(jax.random.key(int(rng.integers(1 << 30))), rows), tree, jnp.asarray(tokens),
            None if probs is None else jnp.asarray(probs), jnp.asarray(logits), cfg)
    num, _, emitted = jax.device_get(tree_accept(*args))
    want_num, want_emitted = jax.device_get(jax.jit(textbook_accept, static_argnums=1)(*args))
    np.testing.assert_array_equal(num, want_num)
    assert num.max() > 0 and num.min() < tree.depth
    for b in range(rows):
        np.testing.assert_array_equal(emitted[b, : num[b] + 1], want_emitted[b, : num[b] + 1])
