"""Verify and sparse attention: Pallas kernels (interpret mode on CPU) against the jnp references,
and the references against float64 NumPy.

Inputs are fresh normal draws (fixed seed per case). Interpret mode fills unwritten kernel outputs
with NaN, so comparing every element also catches blocks, row blocks or splits the kernel forgot to
write. Positions cover 0, S-1, lengths that are not multiples of the block size, and a garbage row
with non-monotone positions (a finished sequence). Draft trees: verification of up to 64 rows, and
sparse drafting of the rows of one depth (a non-square ancestor mask).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import (
    sparse_attention_pallas,
    sparse_attention_reference,
)
from jaxspec.decoding.tree import TreeShape
from pallas_kernels._common import merge_splits_pallas, num_splits, row_blocks
from pallas_kernels.verify_attention import (
    Collect,
    TreeMask,
    verify_attention_pallas,
    tree_words,
    verify_attention_reference,
)
import paged_pools
from slow_cases import slow_at

LAYERS, LAYER = 3, 1
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def random_inputs(seed, q_shape, B, Hkv, S, Dh, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    cache = (LAYERS, B, Hkv, S, Dh)
    return (jax.random.normal(kq, q_shape, dtype), jax.random.normal(kk, cache, dtype),
            jax.random.normal(kv, cache, dtype))


def f64(x):
    return np.asarray(x).astype(np.float64)


def assert_close(got, want, tol, what):
    """Same -inf pattern, no NaN, max error relative to the largest finite magnitude below tol."""
    got, want = f64(got), f64(want)
    assert got.shape == want.shape, what
    assert not np.isnan(got).any(), f"{what}: NaN"
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=what)
    np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=what)
    err = np.abs(got[finite] - want[finite]).max() / np.abs(want[finite]).max()
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


# ---------------------------------------------------------------- verify attention

def verify_pools(k_cache, v_cache, seed, page_size=64):
    """(k_pool, v_pool, pages): the caches scattered into poisoned pools (tests/paged_pools.py)."""
    (k_pool, v_pool), pages = paged_pools.scatter((k_cache, v_cache), page_size, seed)
    return k_pool, v_pool, pages


def verify_positions(seed, B, T, S):
    """Rows: ends at S-1; starts at 0; starts mid-block; garbage (finished) row."""
    starts = [S - T, 0, 77]
    pos = [np.arange(s, s + T) for s in starts[:B]]
    if B > 3:
        pos.append(np.random.default_rng(seed).integers(0, S, T))
    return jnp.asarray(np.stack(pos), jnp.int32)


def verify_oracle(q, k_cache, v_cache, q_pos, scale, collect, sinks=None, lo=None, tree=None):
    """Row (b, t) sees slots lo[b, t] <= j <= q_pos[b, t] (lo None: 0), with tree = (first, ancestors)
    of the tree's slots only its ancestors; sinks [Hq] join every denominator. Collected weights are
    0, and scores -inf, where the row cannot see the slot by q_pos and lo (the tree aside)."""
    q, k, v, q_pos = f64(q), f64(k_cache[LAYER]), f64(v_cache[LAYER]), np.asarray(q_pos)
    G = q.shape[2] // k.shape[1]
    S = k.shape[2]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    logits = np.einsum("bthd,bhsd->bths", q, k) * scale
    seen = np.arange(S) <= q_pos[:, :, None, None]
    if lo is not None:
        seen = seen & (np.arange(S) >= np.asarray(lo)[:, :, None, None])
    visible = seen
    if tree is not None:
        first, ancestors = tree
        rel = np.arange(S) - np.asarray(first)[:, None]                           # [B, S]
        R = ancestors.shape[1]
        ancestor = np.where((rel >= 0) & (rel < R), ancestors[:, np.clip(rel, 0, R - 1)], rel < 0)
        visible = visible & np.moveaxis(ancestor, 0, 1)[:, :, None, :]
    masked = np.where(visible, logits, -np.inf)
    m = masked.max(-1, keepdims=True)
    sink = -np.inf if sinks is None else f64(sinks)[:, None]
    m = np.maximum(m, sink)
    lse = m + np.log(np.exp(masked - m).sum(-1, keepdims=True) + np.exp(sink - m))
    out = np.einsum("bths,bhsd->bthd", np.exp(masked - lse), v)
    scores = None
    if collect is not None:
        rows = list(collect.rows)
        metric = logits[:, rows]
        if collect.metric == "weight":
            metric = np.where(seen[:, rows], np.exp(metric - lse[:, rows]), 0.0)
        per_row = metric.mean(axis=2)
        if collect.reduce_rows:
            scores = np.where(seen[:, rows[0], 0], per_row.mean(axis=1), -np.inf)
        else:
            scores = np.where(seen[:, rows, 0], per_row, -np.inf)
    return out, lse[..., 0], scores


def test_split_count_follows_skew():
    """Rows whose budgets differ (a shared budget) split as many times more as their skew, within
    the caps: SmolLM2's 384 and 96 draft programs (128 and 32 rows) at balance 2 (bench/splits.py)."""
    assert [num_splits(384, 19), num_splits(384, 19, 2.0), num_splits(96, 19, 2.0)] == [1, 2, 6]
    assert num_splits(96, 19, 1.5) == 4 and num_splits(24, 19, 2.0) == 19  # ceil, then one block a split
    assert num_splits(8, 4096, 8.0) == 64  # MAX_SPLITS


@pytest.mark.parametrize("n_splits, B, Hkv, n_blocks, rows, G, T, dtype", [
    (43, 2, 3, 1, 1, 3, 1, jnp.bfloat16), (5, 2, 2, 2, 5, 2, 9, jnp.float32), (2, 1, 3, 1, 16, 1, 16, jnp.float32)])
def test_merge_splits_kernel(n_splits, B, Hkv, n_blocks, rows, G, T, dtype):
    """The split merge's kernel against float64, its rows unpacked to heads: fresh partials, splits
    that saw no key (lse -inf, out 0), and a row no split saw (out 0, lse -inf); 43 splits fill a
    64-wide tile with masked lanes; 2 blocks of 5 rows for 9 (the last block's padding row dropped)."""
    ko, kl, km = jax.random.split(jax.random.key(n_splits), 3)
    o = jax.random.normal(ko, (B, Hkv, n_blocks, n_splits, rows * G, 64))
    lse = 4 * jax.random.normal(kl, o.shape[:-1])
    unseen = jax.random.bernoulli(km, 0.3, lse.shape).at[0, 1, 0, :, 0].set(True)
    lse, o = jnp.where(unseen, -jnp.inf, lse), jnp.where(unseen[..., None], 0.0, o)
    out, got_lse = merge_splits_pallas(o, lse, dtype, T=T, G=G, interpret=True)
    w = np.exp(f64(lse) - np.max(f64(lse), axis=-2, keepdims=True, initial=-1e300))
    l = w.sum(axis=-2)
    want = np.where(l[..., None] > 0, (w[..., None] * f64(o)).sum(axis=-3) / np.maximum(l, 1e-300)[..., None], 0.0)
    want_lse = np.where(l > 0, np.log(np.maximum(l, 1e-300)) + np.max(f64(lse), axis=-2, initial=-1e300), -np.inf)
    # packed row (block r, row i, head g) of KV head h is query row r * rows + i, head h * G + g
    heads = lambda x: np.moveaxis(x.reshape(B, Hkv, n_blocks * rows, G, *x.shape[4:])[:, :, :T], 1, 2).reshape(
        B, T, Hkv * G, *x.shape[4:])
    assert out.shape == (B, T, Hkv * G, 64) and out.dtype == dtype and got_lse.dtype == jnp.float32
    np.testing.assert_allclose(f64(out), heads(want), rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(f64(got_lse), heads(want_lse), rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(got_lse)[0, 0, G]) and not np.asarray(out)[0, 0, G].any()


VERIFY_CASES = [
    # (B, T, Hq, Hkv, Dh, S, dtype, collect, block_k, n_splits)
    (4, 1, 2, 2, 64, 256, jnp.float32, None, 32, None),
    (3, 16, 4, 2, 128, 256, jnp.bfloat16, Collect((0, 15), "weight", True), 64, None),
    (4, 7, 8, 2, 64, 384, jnp.float32, Collect((0, 6), "logit", True), 32, 3),
    (2, 3, 10, 2, 64, 256, jnp.float32, Collect((0, 1, 2), "logit", False), 32, None),
    (3, 1, 8, 1, 128, 256, jnp.bfloat16, Collect((0,), "weight", False), 64, None),
    (4, 16, 8, 2, 64, 256, jnp.float32, Collect(tuple(range(16)), "weight", False), 32, 5),
    (4, 5, 6, 2, 64, 256, jnp.bfloat16, Collect((0, 2, 4), "logit", True), 32, None),
    (2, 10, 8, 2, 64, 256, jnp.bfloat16, Collect((1, 9), "logit", False), 128, None),
    # row blocks (T > 16): 3 blocks of 14 rows; collected rows shared out over the blocks
    (3, 41, 8, 2, 64, 256, jnp.bfloat16, Collect((0, 20, 40), "weight", False), 32, None),
    # G=3: 4 blocks of 16 rows (48 of a 64-row tile); one collected row, read past block 0's keys
    (4, 64, 6, 2, 64, 256, jnp.float32, Collect((0, 63), "logit", True), 32, 3),
    # G=1: one block of 33 rows
    (2, 33, 2, 2, 64, 384, jnp.float32, Collect(tuple(range(33)), "weight", True), 64, None),
    # one split: the kernel stores the final output in q's dtype, nothing merged
    (3, 7, 6, 2, 64, 256, jnp.bfloat16, Collect((0, 6), "logit", True), 32, 1),
    (2, 1, 4, 2, 64, 256, jnp.float32, Collect((0,), "weight", True), 64, 1),
]


# By default one case a path (no collection; collected rows summed or not; splits; row blocks; the 64-row
# tile; one split); these repeat a path at another dtype or head count: the slow tests (20 minutes).
VERIFY_SLOW = (1, 3, 4, 6, 12)


@pytest.mark.parametrize("case", slow_at(range(len(VERIFY_CASES)), VERIFY_SLOW))
def test_verify_attention(case):
    B, T, Hq, Hkv, Dh, S, dtype, collect, block_k, n_splits = VERIFY_CASES[case]
    q, k_cache, v_cache = random_inputs(100 + case, (B, T, Hq, Dh), B, Hkv, S, Dh, dtype)
    q_pos = verify_positions(100 + case, B, T, S)
    scale = Dh ** -0.5
    want = verify_oracle(q, k_cache, v_cache, q_pos, scale, collect)
    page_size = max(64, block_k)
    args = (q, *verify_pools(k_cache, v_cache, case, page_size), jnp.int32(LAYER), q_pos)
    ref = jax.jit(lambda *a: verify_attention_reference(*a, page_size=page_size, scale=scale,
                                                        collect=collect))(*args)
    kernel = jax.jit(lambda *a: verify_attention_pallas(
        *a, page_size=page_size, scale=scale, collect=collect, interpret=True, block_k=block_k,
        n_splits=n_splits))
    got = kernel(*args)
    tol = TOL[dtype]
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    for name, g, r, w in zip(("out", "lse", "scores"), got, ref, want):
        if collect is None and name == "scores":
            assert g is None and r is None
            continue
        assert_close(r, w, tol, f"reference {name}")
        assert_close(g, r, 2 * tol, f"pallas {name}")


def test_verify_long_rows_fall_back_to_reference():
    q, k_cache, v_cache = random_inputs(7, (1, 65, 4, 64), 1, 2, 128, 64, jnp.float32)
    args = (q, *verify_pools(k_cache, v_cache, 7), LAYER, jnp.arange(60, 125, dtype=jnp.int32)[None])
    collect = Collect((0, 64), "weight", True)
    ref = verify_attention_reference(*args, page_size=64, scale=0.125, collect=collect)
    got = verify_attention_pallas(*args, page_size=64, scale=0.125, collect=collect, interpret=True)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_collect_validation():
    with pytest.raises(ValueError, match="metric"):
        Collect((0,), "prob", True)
    with pytest.raises(ValueError, match="sorted"):
        Collect((3, 1), "logit", True)
    q, k_cache, v_cache = random_inputs(8, (1, 2, 4, 64), 1, 2, 128, 64, jnp.float32)
    args = (q, *verify_pools(k_cache, v_cache, 8), 0, jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="out of range"):
        verify_attention_reference(*args, page_size=64, scale=1.0, collect=Collect((0, 2), "logit", True))
    with pytest.raises(ValueError, match="multiple of block_k"):  # a key block straddling two pages
        verify_attention_pallas(*args, page_size=64, scale=1.0, block_k=128, interpret=True)
    with pytest.raises(ValueError, match="page size"):
        verify_attention_reference(*args, page_size=96, scale=1.0)


def poisoned(cache, lo):
    """cache [L, B, Hkv, S, Dh] with layer LAYER's slots below every row's lo [B, T] poisoned (keys NaN,
    values huge, both finite for v: a weight of 0 times them is 0): reading them must not show."""
    below = jnp.arange(cache.shape[3]) < jnp.min(lo, axis=1)[:, None]               # [B, S]
    return cache.at[LAYER].set(jnp.where(below[:, None, :, None], jnp.nan, cache[LAYER]))


def poisoned_values(cache, lo):
    below = jnp.arange(cache.shape[3]) < jnp.min(lo, axis=1)[:, None]
    return cache.at[LAYER].set(jnp.where(below[:, None, :, None], 1e30, cache[LAYER]))


WINDOW_CASES = [
    # (sinks, window, tree shape, collect, dtype, block_k, n_splits); vegas collects rows 0 and last
    (True, None, None, Collect((0, 6), "weight", True), jnp.float32, 32, 3),
    (False, 40, None, Collect((0, 3, 6), "logit", False), jnp.bfloat16, 32, None),
    (True, 70, None, Collect((0, 6), "weight", True), jnp.float32, 32, 3),
    (True, 45, None, Collect((0, 6), "logit", True), jnp.bfloat16, 64, 1),
    (True, 50, (2, 2), Collect((0, 6), "weight", False), jnp.float32, 32, 2),
]


@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
def test_verify_attention_sinks_and_window(case):
    """Sinks [L, Hq] (read at the layer) in every denominator, the lse and the collected weights; rows
    seeing no slot below lo = q_pos - window + 1 (negative for the sequence starting at 0; 7 rows'
    bounds in different key blocks). Both backends against float64, on caches poisoned below every
    row's bound."""
    sinks_on, window, shape, collect, dtype, block_k, n_splits = WINDOW_CASES[case]
    B, Hq, Hkv, Dh, S = 3, 8, 2, 64, 256
    tree = None if shape is None else TreeShape(shape, "dfs")
    T = 7
    q, k_cache, v_cache = random_inputs(400 + case, (B, T, Hq, Dh), B, Hkv, S, Dh, dtype)
    q_pos = verify_positions(400 + case, B, T, S)
    mask = None
    if tree is not None:
        first = q_pos[:, 0]
        mask = TreeMask(first, tree.ancestors)
    sinks = 2 * jax.random.normal(jax.random.key(case), (LAYERS, Hq)) if sinks_on else None
    lo = None if window is None else q_pos - window + 1
    scale = Dh ** -0.5
    want = verify_oracle(q, k_cache, v_cache, q_pos, scale, collect, None if sinks is None else sinks[LAYER], lo,
                         None if tree is None else (np.asarray(first), tree.ancestors))
    if lo is not None:
        k_cache, v_cache = poisoned(k_cache, lo), poisoned_values(v_cache, lo)
    page_size = max(64, block_k)
    args = (q, *verify_pools(k_cache, v_cache, 400 + case, page_size), jnp.int32(LAYER), q_pos)
    options = dict(page_size=page_size, scale=scale, collect=collect, tree=mask, sinks=sinks, lo=lo)
    ref = jax.jit(lambda *a: verify_attention_reference(*a, **options))(*args)
    got = jax.jit(lambda *a: verify_attention_pallas(*a, interpret=True, block_k=block_k, n_splits=n_splits,
                                                     **options))(*args)
    for name, g, r, w in zip(("out", "lse", "scores"), got, ref, want):
        assert_close(r, w, TOL[dtype], f"reference {name}")
        assert_close(g, w, 2 * TOL[dtype], f"pallas {name}")


def test_verify_attention_options_default_to_none():
    """sinks=None, lo=None is the call without them, output for output."""
    q, k_cache, v_cache = random_inputs(9, (2, 3, 4, 64), 2, 2, 128, 64, jnp.float32)
    q_pos = jnp.asarray([[60, 61, 62], [125, 126, 127]], jnp.int32)
    args = (q, *verify_pools(k_cache, v_cache, 9), LAYER, q_pos)
    collect = Collect((0, 2), "weight", True)
    for attention, kw in ((verify_attention_reference, {}), (verify_attention_pallas, dict(interpret=True))):
        plain = attention(*args, page_size=64, scale=0.125, collect=collect, **kw)
        none = attention(*args, page_size=64, scale=0.125, collect=collect, sinks=None, lo=None, **kw)
        for a, b in zip(plain, none):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- sparse attention

SPARSE_PAGE = 64  # more pages a row than the default 128 (some cases take 128)


def sparse_inputs(seed, B, Hs, K, S, n_idx, tail_start):
    """Distinct slots below tail_start for the first n_idx entries, garbage slots after them."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, S, (B, Hs, K))
    for b in range(B):
        for s in range(Hs):
            idx[b, s, :n_idx[b]] = rng.permutation(tail_start[b])[:n_idx[b]]
    return jnp.asarray(idx, jnp.int32)


def sparse_oracle(q, k_cache, v_cache, idx, n_idx, tail_start, q_slot, scale, first=None,
                  ancestors=None, sinks=None, lo=None):
    """Row (b, t) attends idx[b, s, :n_idx[b]] and the tail tail_start[b] .. q_slot[b, t]; with a
    tree, the tail's committed slots [tail_start, first) and the row's ancestors' slots instead;
    with lo, of these the slots >= lo[b, t]. sinks [Hq] join every denominator."""
    q, k, v = f64(q), f64(k_cache[LAYER]), f64(v_cache[LAYER])
    B, T, Hq, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            if ancestors is None:
                tail = np.arange(tail_start[b], q_slot[b, t] + 1)
            else:
                tail = np.concatenate([np.arange(tail_start[b], first[b]),
                                       first[b] + np.flatnonzero(ancestors[t])])
            for h in range(Hq):
                s = 0 if idx.shape[1] == 1 else h // G
                slots = np.concatenate([idx[b, s, :n_idx[b]], tail])
                if lo is not None:
                    slots = slots[slots >= lo[b, t]]
                logits = k[b, h // G, slots] @ q[b, t, h] * scale
                sink = -np.inf if sinks is None else float(sinks[h])
                m = max(logits.max(initial=-np.inf), sink)
                p = np.exp(logits - m)
                out[b, t, h] = p @ v[b, h // G, slots] / (p.sum() + np.exp(sink - m))
    return out


SPARSE_CASES = [
    # (Hq, Hkv, Hs, Dh, S, K, n_idx, tail_start, q_pos, dtype, block_k, n_splits)
    (8, 2, 1, 128, 512, 40, (30, 40, 7), (100, 300, 480), (120, 315, 511), jnp.float32, 16, None),
    (4, 2, 2, 64, 256, 48, (0, 33, 48), (5, 200, 100), (9, 210, 99), jnp.bfloat16, 16, 3),
    (10, 2, 1, 64, 256, 24, (24, 3, 1), (60, 80, 250), (59, 95, 255), jnp.float32, 16, None),
    (2, 2, 2, 64, 384, 70, (0, 70, 12), (0, 200, 300), (0, 383, 330), jnp.float32, 32, None),
    (8, 1, 1, 128, 256, 33, (20, 33, 9), (128, 64, 10), (140, 100, 15), jnp.bfloat16, 16, None),
    # one split (the final output stored in q's dtype)
    (6, 2, 1, 64, 256, 40, (40, 12, 0), (90, 200, 30), (100, 230, 40), jnp.bfloat16, 16, 1),
]


def sparse_args(q, k_cache, v_cache, idx, ints, seed, page_size=SPARSE_PAGE):
    """The kernels' positional arguments with the caches scattered into poisoned pools
    (tests/paged_pools.py), rows' pages in random order."""
    return (q, *verify_pools(k_cache, v_cache, seed, page_size), jnp.int32(LAYER), idx, *ints)


def run_sparse(q, k_cache, v_cache, idx, ints, scale, capacity, tree, block_k, n_splits, seed,
               page_size=SPARSE_PAGE):
    """(reference, pallas) outputs over paged pools, each under jit."""
    args = sparse_args(q, k_cache, v_cache, idx, ints, seed, page_size)
    options = dict(page_size=page_size, scale=scale, tail_capacity=capacity, tree=tree)
    ref = jax.jit(lambda *a: sparse_attention_reference(*a, **options))(*args)
    got = jax.jit(lambda *a: sparse_attention_pallas(*a, interpret=True, block_k=block_k, n_splits=n_splits,
                                                     **options))(*args)
    return ref, got


@pytest.mark.parametrize("case", range(len(SPARSE_CASES)))
def test_sparse_attention(case):
    """One row per sequence (a chain's draft step)."""
    Hq, Hkv, Hs, Dh, S, K, n_idx, tail_start, q_pos, dtype, block_k, n_splits = SPARSE_CASES[case]
    B = len(n_idx)
    q, k_cache, v_cache = random_inputs(200 + case, (B, 1, Hq, Dh), B, Hkv, S, Dh, dtype)
    idx = sparse_inputs(200 + case, B, Hs, K, S, n_idx, tail_start)
    q_slot = np.asarray(q_pos)[:, None]
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, q_slot)]
    capacity = max(max(p - t + 1 for p, t in zip(q_pos, tail_start)), 1)
    scale = Dh ** -0.5
    want = sparse_oracle(q, k_cache, v_cache, np.asarray(idx), n_idx, tail_start, q_slot, scale)
    ref, got = run_sparse(q, k_cache, v_cache, idx, ints, scale, capacity, None, block_k, n_splits, 200 + case,
                          128 if case % 2 else SPARSE_PAGE)
    assert got.dtype == dtype
    assert_close(ref, want, TOL[dtype], "reference")
    assert_close(got, ref, 2 * TOL[dtype], "pallas")


def test_sparse_attention_reads_a_layer_stack_of_slots():
    """idx as a stack [L, B, Hs, K] (a different selection per layer) is read at the cache's layer."""
    Hq, Hkv, Hs, Dh, S, K, n_idx, tail_start, q_pos, dtype, block_k, n_splits = SPARSE_CASES[1]
    B = len(n_idx)
    q, k_cache, v_cache = random_inputs(280, (B, 1, Hq, Dh), B, Hkv, S, Dh, dtype)
    stack = jnp.stack([sparse_inputs(280 + layer, B, Hs, K, S, n_idx, tail_start) for layer in range(k_cache.shape[0])])
    q_slot = np.asarray(q_pos)[:, None]
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, q_slot)]
    capacity = max(max(p - t + 1 for p, t in zip(q_pos, tail_start)), 1)
    scale = Dh ** -0.5
    want = sparse_oracle(q, k_cache, v_cache, np.asarray(stack[LAYER]), n_idx, tail_start, q_slot, scale)
    ref, got = run_sparse(q, k_cache, v_cache, stack, ints, scale, capacity, None, block_k, n_splits, 280)
    assert_close(ref, want, TOL[dtype], "reference")
    assert_close(got, ref, 2 * TOL[dtype], "pallas")


def test_sparse_attention_rows():
    """T = 20 rows per sequence without a tree (two row blocks at G=4): each row sees the tail up to
    its own q_slot; the last sequence has arbitrary q_slots, some before tail_start (no tail)."""
    B, T, Hq, Hkv, Dh, S, K = 3, 20, 8, 2, 64, 256, 30
    n_idx, tail_start = (30, 5, 17), np.array([101, 60, 200])
    q_slot = np.stack([101 + np.arange(T), 70 + np.arange(T),
                       np.random.default_rng(9).integers(199, 250, T)])
    q, k_cache, v_cache = random_inputs(290, (B, T, Hq, Dh), B, Hkv, S, Dh, jnp.bfloat16)
    idx = sparse_inputs(290, B, Hkv, K, S, n_idx, tail_start)
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, q_slot)]
    capacity = int((q_slot.max(axis=1) - tail_start).max()) + 1
    scale = Dh ** -0.5
    want = sparse_oracle(q, k_cache, v_cache, np.asarray(idx), n_idx, tail_start, q_slot, scale)
    ref, got = run_sparse(q, k_cache, v_cache, idx, ints, scale, capacity, None, 16, None, 290)
    assert_close(ref, want, TOL[jnp.bfloat16], "reference")
    assert_close(got, ref, 2 * TOL[jnp.bfloat16], "pallas")


SPARSE_TREE_CASES = [
    # (tree shape, order, depth, Hq, Hkv, Hs, dtype, block_k, n_splits)
    ((2, 2, 2, 2, 2), "bfs", 5, 8, 2, 1, jnp.bfloat16, 16, None),  # 32 rows, G=4: two row blocks
    ((2, 2, 2, 2, 2), "dfs", 4, 6, 2, 2, jnp.float32, 32, 3),      # 16 rows spread out, G=3
    ((4, 8), "dfs", 2, 6, 2, 1, jnp.float32, 16, None),             # 32 rows, G=3: two row blocks
    ((3, 3, 2), "dfs", 3, 4, 1, 1, jnp.bfloat16, 16, 2),            # 18 rows, G=4
    ((3, 2), "bfs", 1, 8, 2, 2, jnp.float32, 16, None),             # 3 rows, one tile
]


# Case 3 (18 rows, G=4) repeats case 0's path at fewer rows: with the slow tests (20 minutes).
@pytest.mark.parametrize("case", slow_at(range(len(SPARSE_TREE_CASES)), (3,)))
def test_sparse_attention_tree_depth(case):
    """The rows of one depth of a draft tree: each sees the gathered slots, the committed tail before
    the root, and its own ancestors' slots (no sibling, cousin or deeper node)."""
    shape, order, depth, Hq, Hkv, Hs, dtype, block_k, n_splits = SPARSE_TREE_CASES[case]
    tree = TreeShape(shape, order)
    rows = np.flatnonzero(tree.node_depth == depth)
    ancestors = tree.ancestors[rows]                          # [T, R]: non-square
    B, T, Dh, S, K = 3, len(rows), 64, 384, 41
    first = np.array([301, 45, 131])
    tail_start = np.array([290, 45, 100])                     # committed tail: 11, 0, 31 slots
    n_idx = (37, 0, 41)
    q_slot = first[:, None] + rows
    q, k_cache, v_cache = random_inputs(300 + case, (B, T, Hq, Dh), B, Hkv, S, Dh, dtype)
    idx = sparse_inputs(300 + case, B, Hs, K, S, n_idx, tail_start)
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, q_slot)]
    capacity = int((q_slot.max(axis=1) - tail_start).max()) + 1
    scale = Dh ** -0.5
    want = sparse_oracle(q, k_cache, v_cache, np.asarray(idx), n_idx, tail_start, q_slot, scale,
                         first, ancestors)
    mask = TreeMask(jnp.asarray(first, jnp.int32), ancestors)
    page_size = 128 if case % 2 else SPARSE_PAGE
    ref, got = run_sparse(q, k_cache, v_cache, idx, ints, scale, capacity, mask, block_k, n_splits, 300 + case,
                          page_size)
    assert got.dtype == dtype
    assert_close(ref, want, TOL[dtype], "reference")
    assert_close(got, ref, 2 * TOL[dtype], "pallas")
    # a traced mask (the drafter's case) gives the same kernel output
    traced = jax.jit(lambda a, *x: sparse_attention_pallas(
        *x, page_size=page_size, scale=scale, tail_capacity=capacity, interpret=True, block_k=block_k,
        n_splits=n_splits, tree=TreeMask(jnp.asarray(first, jnp.int32), a)))
    args = sparse_args(q, k_cache, v_cache, idx, ints, 300 + case, page_size)
    np.testing.assert_array_equal(np.asarray(traced(jnp.asarray(ancestors), *args)), np.asarray(got))


def path_as_chain(cache, first, path):
    """cache [L, B, Hkv, S, Dh] with slots first[b] + path (a tree row's root-to-node path) copied to
    the consecutive slots first[b] + 0, 1, ...: the path laid out as a chain."""
    for b in range(cache.shape[1]):
        cache = cache.at[:, b, :, first[b] + jnp.arange(len(path))].set(cache[:, b, :, first[b] + path])
    return cache


@jax.jit
def chain_row(q_row, k_cache, v_cache, first, path):
    """(out, lse) of verify_attention_reference for a tree row's query q_row [B, 1, Hq, Dh] over its path
    laid out as a chain; under jit, one compile per path length for every tree (eagerly, ~80 op
    compiles a tree: row slices, index shapes)."""
    k_chain, v_chain = (path_as_chain(x, first, path) for x in (k_cache, v_cache))
    out, lse, _ = verify_attention_reference(q_row, *verify_pools(k_chain, v_chain, len(path)), LAYER,
                                             first[:, None] + len(path) - 1, page_size=64,
                                             scale=q_row.shape[-1] ** -0.5)
    return out, lse


TREE_VERIFY_SHAPES = [((2, 2), "bfs"), ((3, 1, 2), "dfs"), ((1, 1, 1), "bfs"), ((2, 2, 2, 2, 2), "bfs"),
                      ((2, 2, 2, 2, 2), "dfs"), ((3, 3, 2), "dfs")]


# By default the kernel on four shapes (a chain, a dfs tree, both multi-block trees) and the reference on
# two; each backend's other shapes run with the slow tests (the default run's 20 minutes).
@pytest.mark.parametrize("shape,order,pallas", [
    (shape, order, pallas) if (i in (1, 2, 3, 5)) == pallas else pytest.param(shape, order, pallas, marks=pytest.mark.slow)
    for pallas in (False, True) for i, (shape, order) in enumerate(TREE_VERIFY_SHAPES)])
def test_tree_verify_equals_each_path_as_a_chain(shape, order, pallas):
    """Tree rows at slots first + t, each seeing the committed cache and its ancestors: row t's output
    equals a chain verification of its root-to-node path laid out at consecutive slots. 63 rows (two
    5-deep binary trees) and 31 rows (3, 3, 2) take several row blocks in the kernel."""
    tree = TreeShape(shape, order)
    B, Hq, Hkv, Dh, S, T = 2, 8, 2, 32, 256, tree.rows
    q, k_cache, v_cache = random_inputs(70 + T, (B, T, Hq, Dh), B, Hkv, S, Dh, jnp.float32)
    first = jnp.asarray([100, 37], jnp.int32)
    q_pos = first[:, None] + jnp.arange(T, dtype=jnp.int32)
    mask = TreeMask(first, tree.ancestors)
    attention = verify_attention_pallas if pallas else verify_attention_reference
    kw = dict(interpret=True) if pallas else {}
    pools = verify_pools(k_cache, v_cache, T)
    # under jit: one compile of the whole tree's attention (eagerly, each op's compile apart)
    run = lambda tree: jax.jit(lambda *a: attention(*a, LAYER, q_pos, page_size=64, scale=Dh**-0.5, tree=tree,
                                                    **kw))(q, *pools)
    out, lse, _ = run(mask)
    for t in range(T):
        path = np.flatnonzero(tree.ancestors[t])  # root .. t, parents first
        want, want_lse = chain_row(np.asarray(q)[:, t : t + 1], k_cache, v_cache, first, jnp.asarray(path, jnp.int32))
        assert_close(out[:, t : t + 1], want, 1e-5, f"row {t}")
        assert_close(lse[:, t : t + 1], want_lse, 1e-5, f"lse row {t}")
    if max(shape) > 1:  # siblings exist: without the mask some row would see them
        unmasked, _, _ = run(None)
        assert not np.allclose(unmasked, out, atol=1e-3)


SPARSE_WINDOW_CASES = [
    # (sinks, window, tree depth, Hs, dtype, block_k, n_splits)
    (True, None, None, 2, jnp.float32, 16, 3),
    (False, 40, None, 2, jnp.bfloat16, 16, None),
    (True, 40, None, 1, jnp.float32, 16, 2),
    (True, 30, 3, 2, jnp.float32, 16, None),
]


@pytest.mark.parametrize("case", range(len(SPARSE_WINDOW_CASES)))
def test_sparse_attention_sinks_and_window(case):
    """Sinks [L, Hq] in every denominator; rows seeing no gathered or tail slot below lo = q_slot -
    window + 1: sequence 0's bounds cut its gathered slots, sequence 1's its tail, sequence 2 gathers
    nothing; with sinks, sequence 3's row 0 sees no slot at all (out 0). Three rows (or a draft tree's
    depth) per sequence, both backends against float64, on caches poisoned below every row's bound."""
    sinks_on, window, depth, Hs, dtype, block_k, n_splits = SPARSE_WINDOW_CASES[case]
    B, Hq, Hkv, Dh, S, K = 4, 8, 2, 64, 384, 24
    n_idx, tail_start = (24, 10, 0, 6), np.array([120, 60, 200, 300])
    first = ancestors = mask = None
    if depth is None:
        T = 3
        q_slot = tail_start[:, None] + np.array([20, 80, 5, 30])[:, None] + np.arange(T)
    else:
        tree = TreeShape((2, 2, 2), "dfs")
        rows = np.flatnonzero(tree.node_depth == depth)
        ancestors, T = tree.ancestors[rows], len(rows)
        first = tail_start + np.array([20, 80, 5, 30])
        q_slot = first[:, None] + rows
        mask = TreeMask(jnp.asarray(first, jnp.int32), ancestors)
    q, k_cache, v_cache = random_inputs(500 + case, (B, T, Hq, Dh), B, Hkv, S, Dh, dtype)
    idx = sparse_inputs(500 + case, B, Hs, K, S, n_idx, tail_start)
    sinks = 2 * jax.random.normal(jax.random.key(case), (LAYERS, Hq)) if sinks_on else None
    lo = None
    if window is not None:
        lo = q_slot - window + 1
        if sinks_on:
            lo[3, 0] = q_slot[3].max() + 1
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, q_slot)]
    capacity = int((q_slot.max(axis=1) - tail_start).max()) + 1
    scale = Dh ** -0.5
    want = sparse_oracle(q, k_cache, v_cache, np.asarray(idx), n_idx, tail_start, q_slot, scale, first, ancestors,
                         None if sinks is None else np.asarray(sinks[LAYER]), lo)
    if lo is not None:
        k_cache, v_cache = poisoned(k_cache, lo), poisoned_values(v_cache, lo)
        lo = jnp.asarray(lo, jnp.int32)
    args = sparse_args(q, k_cache, v_cache, idx, ints, 500 + case)
    options = dict(page_size=SPARSE_PAGE, scale=scale, tail_capacity=capacity, tree=mask, sinks=sinks, lo=lo)
    ref = jax.jit(lambda *a: sparse_attention_reference(*a, **options))(*args)
    got = jax.jit(lambda *a: sparse_attention_pallas(*a, interpret=True, block_k=block_k, n_splits=n_splits,
                                                     **options))(*args)
    assert_close(ref, want, TOL[dtype], "reference")
    assert_close(got, want, 2 * TOL[dtype], "pallas")
    if sinks_on and window is not None:
        assert not np.asarray(got[3, 0]).any() and not np.asarray(ref[3, 0]).any()


def test_sparse_attention_options_default_to_none():
    """sinks=None, lo=None is the call without them, output for output."""
    Hq, Hkv, Hs, Dh, S, K, n_idx, tail_start, q_pos, dtype, block_k, n_splits = SPARSE_CASES[0]
    B = len(n_idx)
    q, k_cache, v_cache = random_inputs(590, (B, 1, Hq, Dh), B, Hkv, S, Dh, dtype)
    idx = sparse_inputs(590, B, Hs, K, S, n_idx, tail_start)
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, np.asarray(q_pos)[:, None])]
    args = sparse_args(q, k_cache, v_cache, idx, ints, 590)
    for attention, kw in ((sparse_attention_reference, {}), (sparse_attention_pallas, dict(interpret=True))):
        plain = attention(*args, page_size=SPARSE_PAGE, scale=0.125, tail_capacity=32, **kw)
        none = attention(*args, page_size=SPARSE_PAGE, scale=0.125, tail_capacity=32, sinks=None, lo=None, **kw)
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(none))


def test_sparse_attention_rejects_blocks_across_pages():
    """A key block must lie in one page: block_k must divide the page size (and pages tile the pool)."""
    Hq, Hkv, Hs, Dh, S, K, n_idx, tail_start, q_pos, dtype, block_k, n_splits = SPARSE_CASES[0]
    B = len(n_idx)
    q, k_cache, v_cache = random_inputs(591, (B, 1, Hq, Dh), B, Hkv, S, Dh, dtype)
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, np.asarray(q_pos)[:, None])]
    args = sparse_args(q, k_cache, v_cache, sparse_inputs(591, B, Hs, K, S, n_idx, tail_start), ints, 591)
    with pytest.raises(ValueError, match="divide the page size"):
        sparse_attention_pallas(*args, page_size=SPARSE_PAGE, scale=0.125, tail_capacity=32, block_k=128)
    with pytest.raises(ValueError, match="page size"):
        sparse_attention_reference(*args, page_size=96, scale=0.125, tail_capacity=32)


@pytest.mark.parametrize("shape", [(3, 2), (3, 2, 1), (2, 2, 2, 2, 2)])
def test_static_tree_words_are_a_constant(shape):
    """Verification's tree is static: its packed ancestor words come out as NumPy (a constant of the
    program, not a packing kernel before every layer's call), equal bit for bit to the traced packing."""
    rng = np.random.default_rng()
    tree, G = TreeShape(shape, str(rng.choice(["bfs", "dfs"]))), int(rng.choice([1, 3, 4, 8]))
    blocks = row_blocks(tree.rows, G)
    first = jnp.asarray(rng.integers(0, 100, size=2), jnp.int32)
    _, static = tree_words(TreeMask(first, tree.ancestors), G, *blocks)
    traced = jax.jit(lambda a: tree_words(TreeMask(first, a), G, *blocks)[1])(jnp.asarray(tree.ancestors))
    assert isinstance(static, np.ndarray) and static.shape == (2, blocks[0], blocks[2])
    np.testing.assert_array_equal(static, np.asarray(traced))
