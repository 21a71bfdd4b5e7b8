"""quest_pages: Quest's page scores and top-k in one Pallas kernel (interpret mode) and its
einsum + lax.top_k reference, against float64 scores computed here. Per (row, KV head) the first
min(k, #candidates) pages must be distinct candidates (below last_page) whose scores are the largest
(as a multiset: ties arbitrary), and every entry a page in [0, P). The bounds [L, B, Hkv, P, Dh] are
scattered into poisoned pools under a page table (tests/paged_pools.py; a cache page holds page_size / 16
bounds), rows' pages in random order; page ids stay logical.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
import paged_pools
from pallas_kernels.quest_pages import QUEST_PAGE, quest_pages_pallas, quest_pages_reference


def exact_scores(q, kmin, kmax, layer):
    """float64 scores [B, Hkv, P] of layer `layer`."""
    q = np.asarray(q, np.float64)
    B, T, Hq, D = q.shape
    H = kmin.shape[2]
    qg = q.reshape(B, T, H, Hq // H, D)
    pos, neg = np.maximum(qg, 0).sum((1, 3)), np.maximum(-qg, 0).sum((1, 3))
    lo, hi = (np.asarray(b[layer], np.float64) for b in (kmin, kmax))
    return np.einsum("bhd,bhpd->bhp", pos, hi) - np.einsum("bhd,bhpd->bhp", neg, lo)


def assert_pages(idx, scores, last_page, k, k_max, atol):
    idx = np.asarray(idx)
    B, H, P = scores.shape
    assert idx.shape == (B, H, k_max) and idx.dtype == np.int32
    assert ((idx >= 0) & (idx < P)).all()
    for b in range(B):
        n = min(int(k[b]), int(last_page[b]))
        for h in range(H):
            got = idx[b, h, :n]
            assert len(set(got.tolist())) == n, f"({b}, {h}): repeated pages"
            assert (got < last_page[b]).all(), f"({b}, {h}): a page past last_page"
            best = np.sort(scores[b, h, : last_page[b]])[::-1][:n]
            np.testing.assert_allclose(np.sort(scores[b, h, got])[::-1], best, atol=atol, err_msg=f"({b}, {h})")


def random_bounds(seed, shape, integer: bool):
    """kmin <= kmax, integer-valued (exact sums, many ties) or normal."""
    rng = np.random.default_rng(seed)
    lo = rng.integers(-4, 4, shape) if integer else rng.normal(size=shape)
    hi = lo + (rng.integers(0, 3, shape) if integer else np.abs(rng.normal(size=shape)))
    return jnp.asarray(lo, jnp.bfloat16), jnp.asarray(hi, jnp.bfloat16)


def bound_pools(kmin, kmax, page_size, seed):
    """(kmin pool, kmax pool, pages): the rows' bounds [L, B, Hkv, P, Dh] (P whole cache pages of
    page_size / 16 bounds) scattered into poisoned pools [L, Hkv, N / 16, Dh]."""
    (lo, hi), pages = paged_pools.scatter((kmin, kmax), page_size // QUEST_PAGE, seed)
    return lo, hi, pages


CASES = [
    # (L, B, T, Hq, Hkv, P, Dh, k_max, k, last_page, chunk, integer, page_size)
    (3, 2, 1, 6, 2, 300, 16, 24, [20, 7], [250, 40], 128, True, 64),      # masked last chunk, ties
    (2, 3, 3, 4, 4, 96, 32, 12, [12, 5, 9], [96, 60, 4], 64, True, 128),  # tree rows; k above the candidates
    (2, 2, 1, 8, 2, 704, 32, 50, [50, 31], [700, 512], 512, False, 256),  # float scores; 256-page score steps
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_quest_pages(case):
    L, B, T, Hq, H, P, D, k_max, k, last_page, chunk, integer, page_size = CASES[case]
    rng = np.random.default_rng(700 + case)
    q_np = rng.integers(-3, 4, (B, T, Hq, D)) if integer else rng.normal(size=(B, T, Hq, D))
    q = jnp.asarray(q_np, jnp.bfloat16)
    kmin, kmax = random_bounds(710 + case, (L, B, H, P, D), integer)
    lo, hi, pages = bound_pools(kmin, kmax, page_size, 730 + case)
    k, last_page = jnp.asarray(k, jnp.int32), jnp.asarray(last_page, jnp.int32)
    atol = 0.0 if integer else 1e-4
    # jitted once, the layer traced: one compile each for all layers
    options = dict(page_size=page_size)
    reference = jax.jit(lambda *a: quest_pages_reference(*a, k_max, **options))
    kernel = jax.jit(lambda *a: quest_pages_pallas(*a, k_max, interpret=True, chunk=chunk, **options))
    for layer in range(L):
        scores = exact_scores(q, kmin, kmax, layer)
        ref = reference(q, lo, hi, pages, jnp.int32(layer), last_page, k)
        assert_pages(ref, scores, last_page, k, k_max, atol)
        got = kernel(q, lo, hi, pages, jnp.int32(layer), last_page, k)
        assert_pages(got, scores, last_page, k, k_max, atol)


def test_quest_pages_rejects_bad_shapes():
    kmin, pages, ones = jnp.ones((2, 2, 12, 16), jnp.bfloat16), jnp.asarray([[1, 2]], jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="k_max"):  # two pages of 64 slots: 8 quest pages a row
        quest_pages_reference(jnp.ones((1, 1, 4, 16)), kmin, kmin, pages, 0, ones, ones, 9, page_size=64)
    with pytest.raises(ValueError, match="shapes do not match"):
        quest_pages_reference(jnp.ones((1, 1, 3, 16)), kmin, kmin, pages, 0, ones, ones, 4, page_size=64)
    with pytest.raises(ValueError, match="shapes do not match"):  # 12 bounds are no whole pages of 128 slots
        quest_pages_reference(jnp.ones((1, 1, 4, 16)), kmin, kmin, pages, 0, ones, ones, 4, page_size=128)


def test_quest_pages_switch_keeps_xla_for_few_long_rows():
    """A few programs over long rows (Qwen3-8B at batch 1) run XLA's scores and top-k under the
    pallas backend; short rows take the kernel (its zeros after k differ from lax.top_k's pages)."""
    rng = np.random.default_rng(720)
    for H, P, D, fused in ((2, 2048, 32, False), (2, 64, 16, True)):
        q = jnp.asarray(rng.normal(size=(1, 1, 4, D)), jnp.bfloat16)
        kmin, kmax = random_bounds(721, (1, 1, H, P, D), integer=False)
        lo, hi, pages = bound_pools(kmin, kmax, 128, 722)
        last, k = jnp.asarray([P], jnp.int32), jnp.asarray([3], jnp.int32)
        got = pallas_kernels.quest_pages(q, lo, hi, pages, 0, last, k, 8, page_size=128, backend="pallas")
        ref = quest_pages_reference(q, lo, hi, pages, 0, last, k, 8, page_size=128)
        assert_pages(got, exact_scores(q, kmin, kmax, 0), last, k, 8, 1e-4)
        assert (np.asarray(got)[..., 3:] == 0).all() == fused
        assert np.array_equal(got, ref) != fused
