"""SSV grouped NSA verification of draft-tree rows (pallas_kernels/nsa_grouped.py) against the per-row
oracle `nsa_tree_reference` (each row over its root-to-node path), and the Pallas kernel (interpret
mode) against the grouped reference.

Inputs are fresh normal draws (jax.random, one key per case) over a cache whose k_cmp/v_cmp are the
block means of its keys/values, as the engine keeps them, in paged pools (tests/paged_pools.scatter:
rows' pages in random order, the other pages poisoned); every batch has one root mid-block and one
on a block boundary. Selections come from the rows' own compressed scores (select_blocks), so they
overlap as real ones do. Interpret mode fills unwritten kernel outputs with NaN.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxspec.decoding.tree import TreeShape
from pallas_kernels.nsa_compressed import nsa_compressed_pallas, nsa_compressed_reference, select_blocks
from pallas_kernels.nsa_grouped import (
    SHARED_GROUP,
    auto_group,
    group_schedule,
    nsa_grouped_pallas,
    nsa_grouped_reference,
    nsa_tree_compressed,
)
from pallas_kernels.nsa_selected import nsa_selected_reference
from pallas_kernels.nsa_tree import nsa_tree_reference, path_slot_map, tree_paths
from test_kernels_attention import assert_close
from test_kernels_nsa import LAYER, LAYERS, PAGE, TOL, paged_nsa, poisoned
from slow_cases import slow_at

SLOTS = 640


def tree_inputs(seed, tree: TreeShape, *, B=2, Hq=6, Hkv=2, Dh=16, bs=16, offset=7, dtype=jnp.float32,
                at_end=False):
    """q, k, v, k_cmp, v_cmp (pools), pages, gates, first for a batch of B trees; root b sits at block
    4 + 5*b, `offset` slots in for even b and on the block boundary for odd b; with `at_end` the last
    tree ends at the cache's last slot instead."""
    keys = jax.random.split(jax.random.key(seed), 4)
    T = tree.rows
    k, v = (jax.random.normal(kk, (LAYERS, B, Hkv, SLOTS, Dh), jnp.float32).astype(dtype) for kk in keys[:2])
    means = lambda x: x.astype(jnp.float32).reshape(LAYERS, B, Hkv, SLOTS // bs, bs, Dh).mean(axis=4).astype(dtype)
    q = jax.random.normal(keys[2], (B, T, Hq, Dh), jnp.float32).astype(dtype)
    gates = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, Hq, 3), jnp.float32))
    first = [(4 + 5 * b) * bs + (offset if b % 2 == 0 else 0) for b in range(B)]
    first = jnp.asarray(first[:-1] + [SLOTS - T] if at_end else first, jnp.int32)
    (k, v, k_cmp, v_cmp), pages = paged_nsa((k, v, means(k), means(v)), bs, seed)
    return q, k, v, k_cmp, v_cmp, pages, gates, first


def jitted(fn, **static):
    """fn compiled with `static` bound. Outputs compared bit for bit come from compiled programs on
    both sides: op-by-op dispatch may round the same math differently from XLA's fusions."""
    return jax.jit(functools.partial(fn, **static))


def oracle(q, k, v, pages, first, idx, o_cmp, gates, *, ancestors, **kw):
    """The per-row selected + window branches of nsa_tree_reference."""
    depth, paths = tree_paths(ancestors)
    q_pos = first[:, None] + jnp.asarray(depth)
    return nsa_selected_reference(q, k, v, pages, LAYER, q_pos, idx, o_cmp, gates, page_size=PAGE,
                                  slot_of=path_slot_map(first, paths), **kw)


def own_selection(q, k, v, k_cmp, v_cmp, pages, first, ancestors, bs, S, rule="exact"):
    """(o_cmp, idx): the rows' compressed output and their top-S blocks."""
    def select(q, k, v, k_cmp, v_cmp, pages, first):
        o_cmp, weights, q_pos = nsa_tree_compressed(q, k, v, k_cmp, v_cmp, pages, LAYER, first, ancestors,
                                                    page_size=PAGE, block_size=bs, scale=q.shape[-1] ** -0.5)
        return o_cmp, select_blocks(weights, q_pos, block_size=bs, block_counts=S, rule=rule)

    return jax.jit(select)(q, k, v, k_cmp, v_cmp, pages, first)


# ---------------------------------------------------------------- the compressed branch

@pytest.mark.parametrize("shape, order, offset, rule, backend", [  # references of shapes the kernel runs: slow (20 minutes)
    ((2, 2), "dfs", 14, "exact", "reference"),
    pytest.param((3, 2, 1), "bfs", 13, "nsa1b", "reference", marks=pytest.mark.slow),
    ((3, 2, 1), "bfs", 13, "nsa1b", "pallas"),
    pytest.param((1,) * 20, "bfs", 5, "exact", "reference", marks=pytest.mark.slow),  # a chain that completes a block inside the tree
    ((1,) * 20, "bfs", 5, "exact", "pallas"),
    ((2,) * 5, "bfs", 9, "nsa1b", "reference"),        # 63 rows
    ((2,) * 5, "bfs", 9, "nsa1b", "pallas"),
])
def test_tree_compressed_equals_the_reference(shape, order, offset, rule, backend):
    tree = TreeShape(shape, order)
    q, k, v, k_cmp, v_cmp, pages, gates, first = tree_inputs(10 + len(shape) + offset, tree, offset=offset)
    bs, S, scale = 16, 3, 0.25
    compressed = (functools.partial(nsa_compressed_pallas, interpret=True, block_n=16) if backend == "pallas"
                  else nsa_compressed_reference)
    o_cmp, weights, q_pos = jitted(nsa_tree_compressed, ancestors=tree.ancestors, page_size=PAGE, block_size=bs,
                                   scale=scale, compressed=compressed)(q, k, v, k_cmp, v_cmp, pages, LAYER, first)
    cmp_only = jnp.zeros_like(gates).at[..., 0].set(1.0)                     # out = o_cmp
    want_o, want_w, want_pos = jitted(nsa_tree_reference, ancestors=tree.ancestors, page_size=PAGE, block_size=bs,
                                      block_counts=S, window=0, rule=rule, scale=scale)(
        q, k, v, k_cmp, v_cmp, pages, LAYER, first, gates=cmp_only)
    np.testing.assert_array_equal(q_pos, want_pos)
    assert_close(o_cmp, want_o, 1e-5, "o_cmp")
    assert_close(weights, want_w, 1e-5, "weights")
    select = functools.partial(select_blocks, q_pos=q_pos, block_size=bs, block_counts=S, rule=rule)
    np.testing.assert_array_equal(select(weights), select(want_w))


# ---------------------------------------------------------------- the schedule

def test_group_schedule():
    """Union, count, membership and tree-key selection against loops; shared groups take their first
    row's blocks."""
    tree = TreeShape((3, 2, 2), "dfs")
    q, k, v, k_cmp, v_cmp, pages, _, first = tree_inputs(20, tree)
    bs, S, T = 16, 4, tree.rows
    _, idx = own_selection(q, k, v, k_cmp, v_cmp, pages, first, tree.ancestors, bs, S)
    depth = tree.node_depth
    for group, shared in ((4, False), (8, True), (5, False), (1, False)):
        schedule = jitted(group_schedule, depth=depth, group=group, shared=shared, block_size=bs)  # eagerly ~1.3 s a group
        sched = jax.tree.map(np.asarray, schedule(idx, first))
        row_idx = np.asarray(idx)[:, np.arange(T) // group * group] if shared else np.asarray(idx)
        np.testing.assert_array_equal(sched.row_idx, row_idx)
        for b, h, n in np.ndindex(sched.count.shape):
            rows = range(n * group, min((n + 1) * group, T))
            union = sorted({int(c) for t in rows for c in row_idx[b, t, h] if c >= 0})
            blocks = sched.blocks[b, h, n]
            assert sched.count[b, h, n] == len(union) and list(blocks[:len(union)]) == union
            assert (blocks[len(union):] == -1).all()
            for u, c in enumerate(union):
                want = [c in row_idx[b, t, h] for t in rows] + [False] * (group - len(rows))
                np.testing.assert_array_equal(sched.member[b, h, n, u], want)
            assert not sched.member[b, h, n, len(union):].any()
        tree_blocks = (np.asarray(first)[:, None] + depth) // bs
        want = (row_idx[:, :, :, None, :] == tree_blocks[:, None, None, :, None]).any(-1)
        np.testing.assert_array_equal(sched.tree_selected, want)


# ---------------------------------------------------------------- exact and shared groups (references)

@pytest.mark.parametrize("shape, order, groups", [  # the bfs 63-row tree and the chain: slow tests (20 minutes)
    ((3, 2, 2), "dfs", (1, 4, 8, 5)),
    pytest.param((1,) * 16, "bfs", (4, 16), marks=pytest.mark.slow),
    pytest.param((2,) * 5, "bfs", (8, 16), marks=pytest.mark.slow),
    ((2,) * 5, "dfs", (16, 32)),
])
def test_exact_groups_equal_the_oracle_bit_for_bit(shape, order, groups):
    tree = TreeShape(shape, order)
    q, k, v, k_cmp, v_cmp, pages, gates, first = tree_inputs(30 + len(shape), tree)
    kw = dict(block_size=16, window=24, scale=0.25)
    o_cmp, idx = own_selection(q, k, v, k_cmp, v_cmp, pages, first, tree.ancestors, 16, 4)
    want = jitted(oracle, ancestors=tree.ancestors, **kw)(q, k, v, pages, first, idx, o_cmp, gates)
    for group in groups:
        got = jitted(nsa_grouped_reference, ancestors=tree.ancestors, page_size=PAGE, group=group, shared=False, **kw)(
            q, k, v, pages, LAYER, first, idx=idx, o_cmp=o_cmp, gates=gates)
        np.testing.assert_array_equal(got, want, err_msg=f"group {group}")


def test_tree_attention_equals_nsa_tree_reference():
    """The full refresh layer (compressed branch, selection, grouped branches, the group by the shape)
    is nsa_tree_reference's result; with the compressed gate at 0 the selection and the other branches
    are bit for bit."""
    tree = TreeShape((3, 2, 2), "bfs")
    q, k, v, k_cmp, v_cmp, pages, gates, first = tree_inputs(40, tree)
    kw = dict(page_size=PAGE, block_size=16, block_counts=3, window=24, rule="nsa1b", scale=0.25)
    run = jax.jit(lambda gates: pallas_kernels.nsa_tree_attention(
        q, k, v, k_cmp, v_cmp, pages, LAYER, first, tree.ancestors, gates, group=0, shared=False, **kw))
    for g_cmp in (gates[..., 0], jnp.zeros_like(gates[..., 0])):
        gated = gates.at[..., 0].set(g_cmp)
        out, weights, q_pos, idx = run(gated)
        want, want_w, want_pos = jitted(nsa_tree_reference, ancestors=tree.ancestors, **kw)(
            q, k, v, k_cmp, v_cmp, pages, LAYER, first, gates=gated)
        np.testing.assert_array_equal(q_pos, want_pos)
        assert_close(weights, want_w, 1e-5, "weights")
        np.testing.assert_array_equal(idx, select_blocks(want_w, want_pos, block_size=16, block_counts=3, rule="nsa1b"))
        if (g_cmp == 0).all():
            np.testing.assert_array_equal(out, want)
        else:
            assert_close(out, want, 1e-5, "out")


def test_auto_group_fills_the_grid_before_it_shares_loads():
    """Group 0's choice: one row per program until the grid has 256 programs to spare (the measured
    shapes: a 5-row chain at batch 1 and 8, SmolLM2's 3 KV heads), then the largest group that keeps
    them (63 rows at batch 8: 4; 16 rows at batch 32: 4, at 128: 8); a shared index keeps 8."""
    cases = {(1, 5): 1, (8, 5): 1, (1, 63): 1, (8, 16): 1, (8, 63): 4, (32, 16): 4, (128, 16): 8}
    for (batch, rows), group in cases.items():
        assert auto_group(batch, rows, 3, shared=False) == group, (batch, rows)
        assert auto_group(batch, rows, 3, shared=True) == SHARED_GROUP


def test_shared_index_is_the_representatives_selection():
    """Shared groups: every row attends as if it had selected its group's first row's blocks; that
    differs from exact groups here, where the rows of a group select different blocks."""
    tree = TreeShape((4, 2), "bfs")
    q, k, v, k_cmp, v_cmp, pages, gates, first = tree_inputs(50, tree)
    kw = dict(block_size=16, window=24, scale=0.25)
    o_cmp, idx = own_selection(q, k, v, k_cmp, v_cmp, pages, first, tree.ancestors, 16, 4)
    T = tree.rows
    for group in (4, 8):
        rep = np.arange(T) // group * group
        assert (np.asarray(idx) != np.asarray(idx)[:, rep]).any(axis=(2, 3)).any(), "rows select alike"
        grouped = lambda shared: jitted(nsa_grouped_reference, ancestors=tree.ancestors, page_size=PAGE, group=group,
                                        shared=shared, **kw)(q, k, v, pages, LAYER, first, idx=idx, o_cmp=o_cmp,
                                                             gates=gates)
        shared = grouped(True)
        want = jitted(oracle, ancestors=tree.ancestors, **kw)(q, k, v, pages, first, idx[:, rep], o_cmp, gates)
        np.testing.assert_array_equal(shared, want)
        exact = grouped(False)
        assert np.abs(np.asarray(shared) - np.asarray(exact)).max() > 1e-3


def test_reuse_drops_the_compressed_term():
    """A reuse layer (idx given): no compressed branch (weights None); the output is the oracle's
    with the compressed gate's term dropped, on both backends (to rounding: XLA contracts the two
    remaining gated terms into a fused multiply-add its own way)."""
    tree = TreeShape((2, 2, 1), "dfs")
    q, k, v, k_cmp, v_cmp, pages, gates, first = tree_inputs(60, tree)
    _, idx = own_selection(q, k, v, k_cmp, v_cmp, pages, first, tree.ancestors, 16, 4)
    kw = dict(block_size=16, window=24, scale=0.25)
    want = jitted(oracle, ancestors=tree.ancestors, **kw)(q, k, v, pages, first, idx, jnp.zeros_like(q), gates)
    for backend in ("reference", "pallas"):
        out, weights, q_pos, got_idx = jitted(
            pallas_kernels.nsa_tree_attention, ancestors=tree.ancestors, page_size=PAGE, group=4, shared=False,
            block_counts=4, rule="exact", backend=backend, **kw)(q, k, v, k_cmp, v_cmp, pages, LAYER, first,
                                                                 gates=gates, idx=idx)
        assert weights is None
        np.testing.assert_array_equal(got_idx, idx)
        np.testing.assert_array_equal(q_pos, first[:, None] + tree.node_depth)
        assert_close(out, want, 1e-6 if backend == "reference" else 1e-5, f"{backend} reuse")


# ---------------------------------------------------------------- the Pallas kernel

PALLAS_CASES = [
    # (shape, order, group, shared, with o_cmp, bs, window, Hq, Hkv, Dh, dtype, max_tile, at_end)
    ((1,) * 8, "bfs", 4, False, True, 16, 24, 9, 3, 64, jnp.float32, None, False),      # SmolLM2 heads
    ((2,) * 5, "bfs", 16, False, True, 16, 40, 6, 2, 16, jnp.float32, None, False),     # 63 rows
    ((3, 2, 2), "dfs", 8, True, False, 32, 0, 32, 2, 16, jnp.bfloat16, None, False),    # G 16, no window
    ((7,) + (1,) * 8, "bfs", 1, False, True, 32, 100, 6, 2, 16, jnp.bfloat16, None, False),  # 64 rows, vanilla
    ((1,) * 63, "bfs", 16, True, True, 16, 24, 32, 2, 16, jnp.float32, 1024, False),    # 64 rows, 4 row blocks
    ((4, 2), "bfs", 4, False, False, 16, 16, 32, 2, 32, jnp.bfloat16, None, True),
    ((2, 2, 2), "dfs", 8, False, True, 32, 48, 9, 3, 64, jnp.bfloat16, None, False),    # SmolLM2 heads
]


# Cases 3, 5 and 6 (a vanilla 64-row tree, a 6-row tree at the cache's end, SmolLM2's heads in bf16)
# repeat paths of the others: the slow tests (the default run's 20 minutes).
@pytest.mark.parametrize("case", slow_at(range(len(PALLAS_CASES)), (3, 5, 6)))
def test_grouped_pallas(case):
    shape, order, group, shared, with_cmp, bs, window, Hq, Hkv, Dh, dtype, max_tile, at_end = PALLAS_CASES[case]
    tree = TreeShape(shape, order)
    q, k, v, k_cmp, v_cmp, pages, gates, first = tree_inputs(100 + case, tree, Hq=Hq, Hkv=Hkv, Dh=Dh, bs=bs,
                                                             offset=3 + 2 * case, dtype=dtype, at_end=at_end)
    o_cmp, idx = own_selection(q, k, v, k_cmp, v_cmp, pages, first, tree.ancestors, bs, 4, rule="nsa1b")
    o_cmp = o_cmp if with_cmp else None
    kw = dict(ancestors=tree.ancestors, page_size=PAGE, group=group, shared=shared, block_size=bs, window=window,
              scale=Dh**-0.5)
    want = jitted(nsa_grouped_reference, **kw)(q, k, v, pages, LAYER, first, idx=idx, o_cmp=o_cmp, gates=gates)
    last = first + tree.rows - 1
    got = jitted(nsa_grouped_pallas, interpret=True, max_tile=max_tile, **kw)(
        q, poisoned(k, pages, PAGE, last), poisoned(v, pages, PAGE, last), pages, LAYER, first, idx=idx, o_cmp=o_cmp,
        gates=gates)
    assert got.dtype == dtype
    assert_close(got, want, TOL[dtype], "grouped kernel")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_poisoned_cache_does_not_leak(backend):
    """NaN in the other layers, in the slots past the tree and in the compressed blocks no row reads
    from k_cmp/v_cmp: the full refresh layer's outputs are finite and equal those of a clean cache."""
    tree = TreeShape((3, 2), "bfs")
    q, k, v, k_cmp, v_cmp, pages, gates, first = tree_inputs(70, tree, Hq=9, Hkv=3)
    kw = dict(page_size=PAGE, group=4, shared=False, block_size=16, block_counts=4, window=24, rule="exact",
              scale=0.25, backend=backend)
    run = jax.jit(lambda k, v, k_cmp, v_cmp: pallas_kernels.nsa_tree_attention(
        q, k, v, k_cmp, v_cmp, pages, LAYER, first, tree.ancestors, gates, **kw))
    clean = run(k, v, k_cmp, v_cmp)
    last, last_block = first + tree.rows - 1, first // 16 - 1
    dirty = run(poisoned(k, pages, PAGE, last), poisoned(v, pages, PAGE, last),
                poisoned(k_cmp, pages, PAGE // 16, last_block), poisoned(v_cmp, pages, PAGE // 16, last_block))
    for name, got, want in zip(("out", "weights", "q_pos", "idx"), dirty, clean):
        assert np.isfinite(np.asarray(got)).all(), name
        np.testing.assert_array_equal(got, want, err_msg=name)
