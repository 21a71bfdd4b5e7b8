"""NSA kernels: the Pallas kernels (interpret mode on CPU) against the jnp references, and the
references against NumPy loops written from the formulas (docs/architecture.md, "NSA and SSV").

Inputs are fresh normal draws (np.random.default_rng, one seed per case). Positions per row mix 0,
block boundaries (c*bs - 1: block c-1 just complete; c*bs: the next one not yet), the last slot and
random ones. Every function reads paged pools (tests/paged_pools.scatter: rows' pages in random
order, the other pages poisoned); the oracles read the pools' logical view. The kernels' caches are
poisoned further: NaN in every other layer and past each sequence's last position (compressed: in
the blocks no row of the sequence sees), which a kernel may only mask or skip; interpret mode also
fills unwritten outputs (and out-of-bounds reads) with NaN.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_kernels
from pallas_kernels.nsa_compressed import (
    nsa_compressed_pallas,
    nsa_compressed_reference,
    radix_topk,
    select_blocks,
)
from pallas_kernels.nsa_selected import nsa_selected_pallas, nsa_selected_reference
from pallas_kernels.paging import logical_view
from paged_pools import scatter
from test_kernels_attention import assert_close, f64, path_as_chain
from slow_cases import slow_at

LAYERS, LAYER = 3, 1
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
PAGE = 64  # the smallest page size: the most page boundaries in a short cache


def paged_nsa(caches, bs, seed, page_size=PAGE):
    """(pools, pages): k, v [L, B, Hkv, S, Dh] and k_cmp, v_cmp [L, B, Hkv, S / bs, Dh] scattered under
    one table."""
    return scatter(caches, (page_size, page_size, page_size // bs, page_size // bs), seed)


def positions(rng, B, T, slots, bs):
    """[B, T] int32: each row draws from 0, block boundaries, the last slot and random slots; the
    first row always holds the last slot, the last row position 0."""
    special = [0, bs - 1, bs, 2 * bs - 1, 2 * bs, 3 * bs - 1, slots - bs - 1, slots - bs, slots - 1]
    pool = np.concatenate([special, rng.integers(0, slots, 8)])
    pos = rng.choice(pool, (B, T))
    pos[0, -1], pos[-1, 0] = slots - 1, 0
    return jnp.asarray(pos, jnp.int32)


def normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def poisoned(pool, pages, page_size, last):
    """NaN in every layer but LAYER of a pool [L, Hkv, N, Dh] and at each row's logical entries past
    last[b] (page_size: the pool's entries a page)."""
    pages, last = np.asarray(pages), np.asarray(last)
    entries = np.arange(pages.shape[1] * page_size)
    beyond = [pages[b, s // page_size] * page_size + s % page_size
              for b in range(len(pages)) for s in entries[entries > last[b]]]
    return pool.at[:, :, np.asarray(beyond, np.int32)].set(jnp.nan).at[np.arange(LAYERS) != LAYER].set(jnp.nan)


# ---------------------------------------------------------------- NumPy oracles

def compressed_oracle(q, k_cmp, v_cmp, q_pos, bs, scale, extra=None):
    """(o, weights) of each row's softmax over its visible blocks, plus its visible extra keys
    (k_x, v_x [B, T, P, Hkv, Dh], visible_x [B, T, P]), whose weights are columns NB.."""
    q, k, v, q_pos = f64(q), f64(k_cmp[LAYER]), f64(v_cmp[LAYER]), np.asarray(q_pos)
    B, T, Hq, Dh = q.shape
    Hkv, NB = k.shape[1], k.shape[2]
    G = Hq // Hkv
    k_x, v_x, vis_x = (f64(extra[0]), f64(extra[1]), np.asarray(extra[2])) if extra else (None, None, None)
    P = 0 if extra is None else vis_x.shape[2]
    o, w = np.zeros_like(q), np.zeros((B, T, Hkv, NB + P))
    for b in range(B):
        for t in range(T):
            seen = [c for c in range(NB) if (c + 1) * bs - 1 <= q_pos[b, t]]
            seen_x = [j for j in range(P) if vis_x[b, t, j]]
            for h in range(Hq):
                keys = np.concatenate([k[b, h // G, seen]] + ([k_x[b, t, seen_x, h // G]] if P else []))
                values = np.concatenate([v[b, h // G, seen]] + ([v_x[b, t, seen_x, h // G]] if P else []))
                if not len(keys):
                    continue
                logits = keys @ q[b, t, h] * scale
                p = np.exp(logits - logits.max())
                p /= p.sum()
                o[b, t, h] = p @ values
                w[b, t, h // G, seen + [NB + j for j in seen_x]] += p
    return o, w


def extra_keys(rng, B, T, P, Hkv, Dh, dtype):
    """(k_x, v_x, visible_x): per-row extra keys, about a third of them invisible, one row none."""
    k_x, v_x = (normal(rng, (B, T, P, Hkv, Dh), dtype) for _ in range(2))
    visible = rng.uniform(size=(B, T, P)) < 0.67
    visible[0, 0] = False
    return k_x, v_x, jnp.asarray(visible)


def softmax_attend(q, k, v, scale):
    """One query head q [Dh] over k, v [n, Dh]; 0 for no key."""
    if not len(k):
        return np.zeros_like(q)
    logits = k @ q * scale
    p = np.exp(logits - logits.max())
    return p @ v / p.sum()


def selected_oracle(q, k_cache, v_cache, q_pos, idx, o_cmp, gates, bs, window, scale):
    q, k, v, o_cmp, gates = (f64(x) for x in (q, k_cache[LAYER], v_cache[LAYER], o_cmp, gates))
    q_pos, idx = np.asarray(q_pos), np.asarray(idx)
    B, T, Hq, _ = q.shape
    G = Hq // k.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            p = q_pos[b, t]
            for h in range(Hq):
                kh, vh = k[b, h // G], v[b, h // G]
                sel = [s for c in idx[b, t, h // G] if c >= 0 for s in range(c * bs, (c + 1) * bs) if s <= p]
                win = list(range(max(p - window + 1, 0), p + 1)) if window else []
                g = gates[b, t, h]
                out[b, t, h] = (g[0] * o_cmp[b, t, h] + g[1] * softmax_attend(q[b, t, h], kh[sel], vh[sel], scale)
                                + g[2] * softmax_attend(q[b, t, h], kh[win], vh[win], scale))
    return out


def select_oracle(weights, p, bs, S, rule):
    """The set of blocks one (row, KV head) selects: sorted, -1 padded to S. weights [NB]."""
    own = p // bs
    earlier = sorted(range(own), key=lambda c: -weights[c])
    if rule == "exact":
        picked = [own] + earlier[:S - 1]
    else:
        start = own // bs * bs                                     # first block of the own chunk
        history = [c for c in earlier if c < start][:bs // 2]
        current = [own] + [c for c in earlier if c >= start]
        candidates = history + (current if start == 0 else current[:bs // 2])
        picked = sorted(candidates, key=lambda c: -np.inf if c == own else -weights[c])[:S]
    return sorted(picked) + [-1] * (S - len(picked))


def sorted_idx(idx):
    """Per-row sorted block indices, -1 last: selections compare as sets."""
    idx = np.asarray(idx)
    return np.sort(np.where(idx < 0, np.iinfo(np.int32).max, idx), axis=-1)


# ---------------------------------------------------------------- references against NumPy

@pytest.mark.parametrize("B, T, Hq, Hkv, Dh, bs, slots, P, seed", [
    (2, 3, 4, 2, 16, 4, 128, 0, 0),
    (1, 5, 6, 2, 8, 8, 192, 0, 1),
    (2, 4, 6, 3, 8, 4, 128, 2, 2),         # with extra keys
])
def test_compressed_reference(B, T, Hq, Hkv, Dh, bs, slots, P, seed):
    rng = np.random.default_rng(seed)
    NB = slots // bs
    q = normal(rng, (B, T, Hq, Dh), jnp.float32)
    k_cmp, v_cmp = (normal(rng, (LAYERS, B, Hkv, NB, Dh), jnp.float32) for _ in range(2))
    q_pos = positions(rng, B, T, slots, bs)
    scale = Dh ** -0.5
    extra = extra_keys(rng, B, T, P, Hkv, Dh, jnp.float32) if P else None
    (k_pool, v_pool), pages = scatter((k_cmp, v_cmp), PAGE // bs, seed)
    o, w = jax.jit(functools.partial(nsa_compressed_reference, page_size=PAGE, block_size=bs, scale=scale))(
        q, k_pool, v_pool, pages, jnp.int32(LAYER), q_pos, extra=extra)
    want_o, want_w = compressed_oracle(q, logical_view(k_pool, pages, PAGE // bs),
                                       logical_view(v_pool, pages, PAGE // bs), q_pos, bs, scale, extra)
    assert_close(o, want_o, 1e-5, "o_cmp")
    assert_close(w, want_w, 1e-5, "weights")
    if extra is None:
        assert (np.asarray(o)[np.asarray(q_pos) < bs - 1] == 0).all()


@pytest.mark.parametrize("B, T, Hq, Hkv, Dh, bs, slots, NS, window, seed", [
    (2, 3, 4, 2, 16, 4, 128, 3, 5, 10),
    (1, 4, 3, 1, 8, 8, 192, 2, 0, 11),
    (2, 2, 2, 2, 8, 4, 64, 6, 70, 12),     # window longer than the cache
])
def test_selected_reference(B, T, Hq, Hkv, Dh, bs, slots, NS, window, seed):
    rng = np.random.default_rng(seed)
    q, o_cmp = (normal(rng, (B, T, Hq, Dh), jnp.float32) for _ in range(2))
    k_cache, v_cache = (normal(rng, (LAYERS, B, Hkv, slots, Dh), jnp.float32) for _ in range(2))
    gates = jnp.asarray(rng.uniform(size=(B, T, Hq, 3)), jnp.float32)
    q_pos = positions(rng, B, T, slots, bs)
    idx = block_indices(rng, q_pos, Hkv, slots // bs, NS, bs)
    scale = Dh ** -0.5
    (k_pool, v_pool), pages = scatter((k_cache, v_cache), PAGE, seed)
    got = jax.jit(functools.partial(nsa_selected_reference, page_size=PAGE, block_size=bs, window=window,
                                    scale=scale))(q, k_pool, v_pool, pages, jnp.int32(LAYER), q_pos, idx, o_cmp, gates)
    want = selected_oracle(q, logical_view(k_pool, pages, PAGE), logical_view(v_pool, pages, PAGE), q_pos, idx,
                           o_cmp, gates, bs, window, scale)
    assert_close(got, want, 1e-5, "nsa output")


def random_weights(rng, B, T, Hkv, NB):
    """Distinct positive importance weights (ties would make the selection ambiguous)."""
    return jnp.asarray(rng.permutation(B * T * Hkv * NB).reshape(B, T, Hkv, NB) + 1.0, jnp.float32)


@pytest.mark.parametrize("rule", ["exact", "nsa1b"])
@pytest.mark.parametrize("bs, NB, S", [(4, 23, 3), (4, 23, 2), (8, 40, 6), (4, 6, 5)])
def test_select_blocks_reference(rule, bs, NB, S):
    rng = np.random.default_rng(20 + NB + S)
    B, T, Hkv = 2, 6, 2
    weights = random_weights(rng, B, T, Hkv, NB)
    q_pos = positions(rng, B, T, NB * bs, bs)
    idx = select_blocks(weights, q_pos, block_size=bs, block_counts=S, rule=rule)
    assert idx.shape == (B, T, Hkv, S) and idx.dtype == jnp.int32
    w, pos = np.asarray(weights), np.asarray(q_pos)
    want = [[[select_oracle(w[b, t, h], pos[b, t], bs, S, rule) for h in range(Hkv)]
             for t in range(T)] for b in range(B)]
    np.testing.assert_array_equal(sorted_idx(idx), sorted_idx(want))


@pytest.mark.parametrize("bs, NB, S", [(8, 70, 4), (16, 100, 8), (4, 30, 1)])
def test_select_rules_agree_for_small_counts(bs, NB, S):
    """With S <= block_size/2 the nsa1b rule is the exact top-S."""
    rng = np.random.default_rng(30 + S)
    weights = random_weights(rng, 2, 5, 2, NB)
    q_pos = positions(rng, 2, 5, NB * bs, bs)
    exact, nsa1b = (select_blocks(weights, q_pos, block_size=bs, block_counts=S, rule=rule)
                    for rule in ("exact", "nsa1b"))
    np.testing.assert_array_equal(sorted_idx(exact), sorted_idx(nsa1b))


# ---------------------------------------------------------------- Pallas against the references

COMPRESSED_CASES = [
    # (B, T, Hq, Hkv, Dh, bs, slots, dtype, block_n, n_splits, max_tile, P extra keys, page size)
    (2, 5, 4, 2, 32, 16, 512, jnp.float32, 16, None, None, 0, 64),
    (1, 16, 3, 1, 16, 16, 320, jnp.float32, 16, 3, 512, 0, 64),            # NB 20, two row blocks of 8
    (3, 1, 32, 2, 64, 16, 256, jnp.bfloat16, 64, None, None, 0, 128),      # NSA-1B heads
    (2, 5, 32, 2, 16, 32, 640, jnp.bfloat16, 16, 2, 1024, 0, 64),          # G 16, row blocks of 3 + 2
    (2, 16, 2, 2, 16, 32, 1152, jnp.float32, 64, None, None, 0, 192),      # G 1, NB 36 < block_n, 6 a page
    (2, 40, 6, 2, 16, 16, 448, jnp.float32, 16, 2, 1024, 2, 64),           # a tree's rows: extra keys, 3 row blocks
    (1, 9, 9, 3, 32, 16, 256, jnp.bfloat16, 16, None, None, 1, 128),       # SmolLM2 heads, bf16 extra keys
]


# Cases 2 and 3 (NSA-1B's heads, G 16 in row blocks) repeat the paths of cases 0 and 1 at other head
# counts: the slow tests (the default run's 20 minutes).
@pytest.mark.parametrize("case", slow_at(range(len(COMPRESSED_CASES)), (2, 3)))
def test_nsa_compressed_pallas(case):
    B, T, Hq, Hkv, Dh, bs, slots, dtype, block_n, n_splits, max_tile, P, page = COMPRESSED_CASES[case]
    rng = np.random.default_rng(100 + case)
    NB = slots // bs
    q = normal(rng, (B, T, Hq, Dh), dtype)
    k_cmp, v_cmp = (normal(rng, (LAYERS, B, Hkv, NB, Dh), dtype) for _ in range(2))
    q_pos = positions(rng, B, T, slots, bs)
    scale = Dh ** -0.5
    extra = extra_keys(rng, B, T, P, Hkv, Dh, dtype) if P else None
    (k_pool, v_pool), pages = scatter((k_cmp, v_cmp), page // bs, 100 + case)
    args = dict(page_size=page, block_size=bs, scale=scale)
    ref = jax.jit(functools.partial(nsa_compressed_reference, **args))(
        q, k_pool, v_pool, pages, jnp.int32(LAYER), q_pos, extra=extra)
    seen = (np.asarray(q_pos).max(axis=1) + 1) // bs - 1                   # last block any row sees
    options = {} if max_tile is None else {"max_tile": max_tile}
    kernel = jax.jit(functools.partial(nsa_compressed_pallas, interpret=True, block_n=block_n, n_splits=n_splits,
                                       **args, **options))
    k_pool, v_pool = (poisoned(x, pages, page // bs, seen) for x in (k_pool, v_pool))
    o, w = kernel(q, k_pool, v_pool, pages, jnp.int32(LAYER), q_pos, extra=extra)
    assert o.dtype == dtype and w.dtype == jnp.float32 and w.shape == (B, T, Hkv, NB + P)
    assert_close(o, ref[0], TOL[dtype], "o_cmp")
    assert_close(w, ref[1], TOL[dtype], "weights")
    invisible = (np.arange(NB) + 1) * bs - 1 > np.asarray(q_pos)[:, :, None, None]
    assert (np.asarray(w)[..., :NB][np.broadcast_to(invisible, (B, T, Hkv, NB))] == 0).all()


def block_indices(rng, q_pos, Hkv, NB, NS, bs):
    """[B, T, Hkv, NS]: distinct blocks, mostly at or before the row's own block, some past it (fully
    masked), about a quarter -1; one row selects nothing."""
    B, T = q_pos.shape
    idx = np.empty((B, T, Hkv, NS), np.int32)
    for b, t, h in np.ndindex(B, T, Hkv):
        own = int(q_pos[b, t]) // bs
        pool = rng.permutation(np.arange(own + 1))[:NS]
        later = rng.permutation(np.arange(own + 1, NB))
        picks = np.concatenate([pool, later])[:NS] if len(pool) < NS else pool
        picks = np.pad(picks, (0, NS - len(picks)), constant_values=-1)
        idx[b, t, h] = np.where(rng.uniform(size=NS) < 0.25, -1, picks)
    idx[-1, -1, 0] = -1
    return jnp.asarray(idx)


SELECTED_CASES = [
    # (B, T, Hq, Hkv, Dh, bs, slots, NS, window, dtype, page size)
    (2, 5, 4, 2, 32, 16, 256, 4, 40, jnp.float32, 64),
    (3, 1, 32, 2, 64, 32, 512, 3, 0, jnp.bfloat16, 128),             # NSA-1B heads
    (1, 16, 3, 1, 16, 16, 320, 5, 100, jnp.float32, 64),            # G 3, window > block_w
    (2, 5, 2, 2, 32, 64, 576, 2, 16, jnp.bfloat16, 192),            # G 1
]


# Case 1 (NSA-1B's heads, no window) with the slow tests (the default run's 20 minutes).
@pytest.mark.parametrize("case", slow_at(range(len(SELECTED_CASES)), (1,)))
def test_nsa_selected_pallas(case):
    B, T, Hq, Hkv, Dh, bs, slots, NS, window, dtype, page = SELECTED_CASES[case]
    rng = np.random.default_rng(200 + case)
    q, o_cmp = (normal(rng, (B, T, Hq, Dh), dtype) for _ in range(2))
    k_cache, v_cache = (normal(rng, (LAYERS, B, Hkv, slots, Dh), dtype) for _ in range(2))
    gates = jnp.asarray(rng.uniform(size=(B, T, Hq, 3)), dtype)
    q_pos = positions(rng, B, T, slots, bs)
    idx = block_indices(rng, np.asarray(q_pos), Hkv, slots // bs, NS, bs)
    scale = Dh ** -0.5
    args = dict(page_size=page, block_size=bs, window=window, scale=scale)
    (k_pool, v_pool), pages = scatter((k_cache, v_cache), page, 200 + case)
    ref = jax.jit(functools.partial(nsa_selected_reference, **args))(
        q, k_pool, v_pool, pages, jnp.int32(LAYER), q_pos, idx, o_cmp, gates)
    last = np.asarray(q_pos).max(axis=1)
    kernel = jax.jit(functools.partial(nsa_selected_pallas, interpret=True, **args))
    got = kernel(q, poisoned(k_pool, pages, page, last), poisoned(v_pool, pages, page, last), pages, jnp.int32(LAYER),
                 q_pos, idx, o_cmp, gates)
    assert got.dtype == dtype
    assert_close(got, ref, TOL[dtype], "nsa output")


def test_pallas_kernels_refuse_pages_their_steps_straddle():
    """A selected-key step (64 keys of a bf16 pool) and a compressed block must each lie in one page."""
    B, T, Hq, Hkv, Dh, bs, page = 1, 2, 4, 2, 16, 64, 96
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    rows, pool, pages = spec(B, T, Hq, Dh), spec(LAYERS, Hkv, 4 * page, Dh), spec(B, 3, dtype=jnp.int32)
    pos = spec(B, T, dtype=jnp.int32)
    with pytest.raises(ValueError, match="page size 96"):
        jax.eval_shape(functools.partial(nsa_selected_pallas, page_size=page, block_size=bs, window=16, scale=0.25),
                       rows, pool, pool, pages, 0, pos, spec(B, T, Hkv, 2, dtype=jnp.int32), rows, spec(B, T, Hq, 3))
    cmp = spec(LAYERS, Hkv, 4 * page // bs, Dh)
    with pytest.raises(ValueError, match="page size 96"):
        jax.eval_shape(functools.partial(nsa_compressed_pallas, page_size=page, block_size=bs, scale=0.25),
                       rows, cmp, cmp, pages, 0, pos)


@pytest.mark.parametrize("rule, bs, NB, S", [("exact", 16, 40, 6), ("nsa1b", 8, 40, 6), ("nsa1b", 4, 64, 3)])
def test_select_blocks_radix_topk(rule, bs, NB, S):
    """The Pallas path's radix select picks the same blocks as lax.top_k (order aside)."""
    rng = np.random.default_rng(300 + NB + S)
    weights = random_weights(rng, 2, 5, 2, NB)
    q_pos = positions(rng, 2, 5, NB * bs, bs)
    select = functools.partial(select_blocks, block_size=bs, block_counts=S, rule=rule)
    want = jax.jit(lambda w, p: select(w, p, topk=lax.top_k))(weights, q_pos)
    got = jax.jit(lambda w, p: select(w, p, topk=functools.partial(radix_topk, interpret=True)))(weights, q_pos)
    np.testing.assert_array_equal(sorted_idx(got), sorted_idx(want))


def test_radix_topk_values():
    rng = np.random.default_rng(310)
    scores = jnp.asarray(rng.standard_normal((3, 50)), jnp.float32).at[0, 7].set(jnp.inf).at[1].set(-jnp.inf)
    vals, idx = jax.jit(lambda s: radix_topk(s, 5, interpret=True))(scores)
    np.testing.assert_array_equal(vals, jnp.take_along_axis(scores, idx, axis=-1))
    np.testing.assert_array_equal(np.sort(vals, axis=-1), np.sort(lax.top_k(scores, 5)[0], axis=-1))


# ---------------------------------------------------------------- the backend switch

def test_backend_switch_nsa():
    """backend "pallas" runs the kernels and the radix select (interpret mode here); the selected
    branch takes the reference from T > 16 rows, the compressed branch from T > 64 (then bit-equal).
    Both backends' selected branch gets the same block list."""
    rng = np.random.default_rng(400)
    B, Hq, Hkv, Dh, bs, slots = 2, 4, 2, 16, 16, 256
    caches = [normal(rng, (LAYERS, B, Hkv, slots // n, Dh), jnp.float32) for n in (1, 1, bs, bs)]
    (k_pool, v_pool, k_cmp, v_cmp), pages = paged_nsa(caches, bs, 400)

    @functools.partial(jax.jit, static_argnames="backend")
    def nsa(q, q_pos, gates, idx, backend):
        o_cmp, w, own_idx = pallas_kernels.nsa_compressed_attention(
            q, k_cmp, v_cmp, pages, LAYER, q_pos, page_size=PAGE, block_size=bs, block_counts=4, rule="nsa1b",
            scale=0.25, backend=backend)
        out = pallas_kernels.nsa_selected_attention(q, k_pool, v_pool, pages, LAYER, q_pos, idx, o_cmp, gates,
                                                    page_size=PAGE, block_size=bs, window=32, scale=0.25,
                                                    backend=backend)
        return o_cmp, w, own_idx, out

    @jax.jit  # eagerly, every op compiles on its own for each T (~2.5 s a T)
    def reference_idx(q, q_pos):
        w = nsa_compressed_reference(q, k_cmp, v_cmp, pages, LAYER, q_pos, page_size=PAGE, block_size=bs,
                                     scale=0.25)[1]
        return select_blocks(w, q_pos, block_size=bs, block_counts=4, rule="nsa1b")

    for T in (3, 20, 70):
        q = normal(rng, (B, T, Hq, Dh), jnp.float32)
        gates = jnp.asarray(rng.uniform(size=(B, T, Hq, 3)), jnp.float32)
        q_pos = positions(rng, B, T, slots, bs)
        idx = reference_idx(q, q_pos)
        want = nsa(q, q_pos, gates, idx, "reference")
        got = nsa(q, q_pos, gates, idx, "pallas")
        np.testing.assert_array_equal(sorted_idx(got[2]), sorted_idx(want[2]), err_msg=f"T={T} idx")
        for name, g, w in zip(("o_cmp", "weights", "out"), got[:2] + got[3:], want[:2] + want[3:]):
            if T > 64:
                np.testing.assert_array_equal(g, w, err_msg=f"T={T} {name}")
            else:
                assert_close(g, w, 1e-5, f"T={T} {name}")


def test_small_blocks_run_the_reference_on_the_pallas_backend():
    """block_size 8 (allowed by the config, below the kernels' tile) gives the reference's result."""
    rng = np.random.default_rng(401)
    B, T, Hq, Hkv, Dh, bs, slots = 1, 2, 4, 2, 16, 8, 128
    caches = [normal(rng, (LAYERS, B, Hkv, slots // n, Dh), jnp.float32) for n in (1, 1, bs, bs)]
    (k_pool, v_pool, k_cmp, v_cmp), pages = paged_nsa(caches, bs, 401)
    q = normal(rng, (B, T, Hq, Dh), jnp.float32)
    gates = jnp.asarray(rng.uniform(size=(B, T, Hq, 3)), jnp.float32)
    q_pos = jnp.asarray([[100, 101]], jnp.int32)

    @functools.partial(jax.jit, static_argnames="backend")  # eagerly, every op compiles on its own per backend
    def nsa(backend):
        o_cmp, _, idx = pallas_kernels.nsa_compressed_attention(
            q, k_cmp, v_cmp, pages, LAYER, q_pos, page_size=PAGE, block_size=bs, block_counts=3, rule="exact",
            scale=0.25, backend=backend)
        return pallas_kernels.nsa_selected_attention(
            q, k_pool, v_pool, pages, LAYER, q_pos, idx, o_cmp, gates, page_size=PAGE, block_size=bs, window=16,
            scale=0.25, backend=backend)

    np.testing.assert_array_equal(nsa(backend="pallas"), nsa(backend="reference"))


# ---------------------------------------------------------------- draft trees


@pytest.mark.parametrize("shape,order,offset", [  # (2, 2) dfs with the slow tests (the default run's 20 minutes)
    pytest.param((2, 2), "dfs", 14, marks=pytest.mark.slow), ((3, 2, 1), "bfs", 13), ((1, 1, 1), "bfs", 15)])
def test_tree_rows_equal_their_paths_as_chains(shape, order, offset):
    """Each tree row (slot first + t, position first + depth) gets the output and block weights of a
    single row at that position over the cache where its root-to-node path sits at consecutive
    slots, compressed blocks recomputed. The root sits `offset` slots into a block, so the tree
    completes a block for its deeper rows."""
    from jaxspec.decoding.tree import TreeShape
    from pallas_kernels.nsa_tree import nsa_tree_reference

    tree = TreeShape(shape, order)
    rng = np.random.default_rng(sum(shape) + offset)
    B, Hq, Hkv, Dh, S, bs, T = 2, 4, 2, 16, 256, 16, tree.rows
    k, v = (normal(rng, (LAYERS, B, Hkv, S, Dh), jnp.float32) for _ in range(2))
    q, gates = normal(rng, (B, T, Hq, Dh), jnp.float32), jax.nn.sigmoid(normal(rng, (B, T, Hq, 3), jnp.float32))
    first = jnp.asarray([5 * bs + offset, 9 * bs + offset], jnp.int32)
    means = lambda x: x.reshape(LAYERS, B, Hkv, S // bs, bs, Dh).mean(axis=4)
    paged = lambda k, v: paged_nsa((k, v, means(k), means(v)), bs, offset)  # the same table every call
    kw = dict(page_size=PAGE, block_size=bs, window=24, scale=Dh**-0.5)
    pools, pages = paged(k, v)
    out, weights, q_pos = jax.jit(lambda q, pools, gates: nsa_tree_reference(
        q, *pools, pages, LAYER, first, tree.ancestors, gates, block_counts=3, rule="exact", **kw))(q, pools, gates)

    @jax.jit  # one compile per path length (eagerly, every op compiles on its own for each row)
    def chain_row(q_row, gates_row, path):
        (k_chain, v_chain, k_cmp, v_cmp), _ = paged(path_as_chain(k, first, path), path_as_chain(v, first, path))
        pos = (first + len(path) - 1)[:, None]
        o_cmp, w = nsa_compressed_reference(q_row, k_cmp, v_cmp, pages, LAYER, pos, page_size=PAGE, block_size=bs,
                                            scale=kw["scale"])
        idx = select_blocks(w, pos, block_size=bs, block_counts=3, rule="exact")
        return nsa_selected_reference(q_row, k_chain, v_chain, pages, LAYER, pos, idx, o_cmp, gates_row, **kw), w

    for t in range(T):
        path = np.flatnonzero(tree.ancestors[t])
        np.testing.assert_array_equal(q_pos[:, t], first + len(path) - 1)
        want, w = chain_row(q[:, t : t + 1], gates[:, t : t + 1], path)
        assert_close(out[:, t : t + 1], want, 1e-5, f"row {t}")
        assert_close(weights[:, t : t + 1], w, 1e-5, f"row {t} weights")
