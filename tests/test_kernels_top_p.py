"""The sort-free nucleus threshold (pallas_kernels/top_p.py): the reference and both Pallas paths (one
program per row, its bracket's held values compared pairwise or searched, or the row searched; and the
split path: each row over many programs), against a float64 NumPy oracle that sorts: walk from the most
likely token, keep it while the mass before it is < top_p."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import top_p as kernels
from pallas_kernels.top_p import SPLIT_MAX_ROWS, top_p_threshold_reference

# The Pallas paths under jit: the split path's launches compile as one program (called eagerly, each
# compiled apart: ~4.4 -> 1.6 s a call), and calls of one shape share their compiled programs.
top_p_threshold_per_row = jax.jit(kernels.top_p_threshold_per_row, static_argnames=("interpret", "chunk", "capacity", "pairwise"))
top_p_threshold_split = jax.jit(kernels.top_p_threshold_split, static_argnames=("interpret", "chunk", "per"))
top_p_threshold_pallas = jax.jit(kernels.top_p_threshold_pallas, static_argnames="interpret")


def oracle(logits, inv_temperature, top_p):
    x = np.asarray(jnp.asarray(logits).astype(jnp.float32) * jnp.float32(inv_temperature))
    out = []
    for row in x.astype(np.float64):
        e = np.exp(row - row.max())
        order = np.argsort(-row, kind="stable")
        mass_before = np.concatenate([[0.0], np.cumsum(e[order])[:-1]]) / e.sum()
        out.append(row[order[mass_before < top_p][-1]])
    return np.asarray(out, np.float32)


def rows(kind, rng, R, V):
    if kind == "normal":
        return 3 * rng.normal(size=(R, V))
    if kind == "ties":  # few distinct values: the threshold's ties are kept
        return rng.integers(-3, 3, size=(R, V)).astype(np.float64)
    if kind == "masked":  # -inf entries (a padded vocabulary), a peaked row
        x = 2 * rng.normal(size=(R, V))
        x[:, rng.random(V) < 0.3] = -np.inf
        x[0, 5] = 40.0
        return x
    if kind == "flat":
        return np.full((R, V), rng.normal())
    if kind == "signs":  # keys of both signs and a wide range: the bracket spans ~2^32 keys
        return rng.choice([-1, 1], size=(R, V)) * np.exp(rng.uniform(-20, 5, size=(R, V)))
    if kind == "zipf":  # shaped like a real model's rows (bench/top_p.py): the bracket's values are held
        return -1.5 * np.log(1.0 + np.stack([rng.permutation(V) for _ in range(R)])) + 0.3 * rng.normal(size=(R, V))
    if kind == "near":  # half the row on 16 neighbouring float32 values: the nucleus ends among them
        x = rng.normal(size=(R, V))
        near = np.float32(2.0) + rng.integers(0, 16, size=(R, V // 2)) * np.spacing(np.float32(2.0))
        x[:, rng.permutation(V)[:V // 2]] = near
        return x
    raise ValueError(kind)


CASES = [  # (kind, R, V, dtype, inv_temperature, top_p)
    ("normal", 5, 1000, jnp.float32, 1 / 0.7, 0.95),
    ("normal", 3, 4099, jnp.float32, 1.0, 0.5),
    ("normal", 4, 777, jnp.bfloat16, 1 / 0.7, 0.9),
    ("normal", 2, 300, jnp.float32, 2.0, 0.999),
    ("ties", 6, 513, jnp.float32, 1.0, 0.6),
    ("ties", 3, 256, jnp.bfloat16, 1 / 1.3, 0.3),
    ("masked", 5, 1000, jnp.float32, 1.0, 0.9),  # the first case's shapes: its compiled kernels serve this one
    ("flat", 2, 600, jnp.float32, 1.0, 0.8),
    ("signs", 3, 2000, jnp.float32, 0.5, 0.7),
    ("near", 3, 3000, jnp.float32, 1.0, 0.5),
    ("near", 2, 1500, jnp.float32, 1.0, 0.7),
    ("zipf", 4, 5000, jnp.float32, 1 / 0.7, 0.95),
    ("zipf", 3, 3000, jnp.bfloat16, 1.0, 0.99),
]


SLOW_CASES = (1, 2, 3, 4, 10, 12)  # each kind runs by default (bfloat16: ties), the rest with the slow tests (20 minutes)


@pytest.mark.parametrize("case", [pytest.param(c, id="-".join(map(str, c[:4])), marks=[pytest.mark.slow] if i in SLOW_CASES else [])
                                  for i, c in enumerate(CASES)])
def test_top_p_threshold(case):
    kind, R, V, dtype, inv_t, top_p = case
    rng = np.random.default_rng(CASES.index(case))
    logits = jnp.asarray(rows(kind, rng, R, V), dtype)
    want = oracle(logits, inv_t, top_p)
    ref = np.asarray(top_p_threshold_reference(logits, inv_t, top_p))
    np.testing.assert_array_equal(ref, want)
    # the bracket's values held and compared pairwise (up to 128), then alternating: held and searched
    # (the pairwise step off), or too many to hold (16): the search over the row
    per_row = np.asarray(top_p_threshold_per_row(logits, inv_t, top_p, interpret=True, chunk=256))
    np.testing.assert_array_equal(per_row, want)
    capacity = (1024, 16)[CASES.index(case) % 2]
    searched = top_p_threshold_per_row(logits, inv_t, top_p, interpret=True, chunk=256, capacity=capacity, pairwise=0)
    np.testing.assert_array_equal(np.asarray(searched), want)
    # the split path, one chunk a program or three (the last program's chunks partly past V)
    per = 1 + 2 * (CASES.index(case) % 2)
    split = np.asarray(top_p_threshold_split(logits, inv_t, top_p, interpret=True, chunk=128, per=per))
    np.testing.assert_array_equal(split, want)
    if kind == "near":  # the nucleus ends inside the cluster: the last pass settled single keys
        assert np.all((want >= 2.0) & (want < 2.0 + 16 * np.spacing(np.float32(2.0))))
    if kind == "flat":
        np.testing.assert_array_equal(per_row, logits[:, 0])


@pytest.mark.parametrize("R, dtype", [(1, jnp.float32), (2, jnp.bfloat16)])
def test_split_path_at_a_large_vocabulary(R, dtype):
    """Qwen3's vocabulary (151936: 38 programs of 4 chunks a row, the last one partly past V) at T 0.7,
    top-p 0.95: top_p_threshold_pallas takes the split path; against the reference and the oracle."""
    rng = np.random.default_rng(100 + R)
    logits = jnp.asarray(3 * rng.normal(size=(R, 151936)), dtype)
    want = oracle(logits, 1 / 0.7, 0.95)
    got = np.asarray(top_p_threshold_pallas(logits, 1 / 0.7, 0.95, interpret=True))
    np.testing.assert_array_equal(np.asarray(top_p_threshold_reference(logits, 1 / 0.7, 0.95)), want)
    np.testing.assert_array_equal(got, want)


def test_path_rule_and_per_row_values():
    """Up to SPLIT_MAX_ROWS rows take the split path, more one program per row; both read each
    row's own temperature and top_p."""
    rng = np.random.default_rng(11)
    R = SPLIT_MAX_ROWS + 1
    logits = jnp.asarray(3 * rng.normal(size=(R, 300)), jnp.float32)
    inv_t = jnp.asarray(rng.uniform(0.5, 2.0, size=R), jnp.float32)
    top_p = jnp.asarray(rng.uniform(0.2, 0.99, size=R), jnp.float32)
    want = np.asarray([oracle(logits[r:r + 1], inv_t[r], top_p[r])[0] for r in range(R)])
    np.testing.assert_array_equal(np.asarray(top_p_threshold_pallas(logits, inv_t, top_p, interpret=True)), want)
    np.testing.assert_array_equal(
        np.asarray(top_p_threshold_pallas(logits[:SPLIT_MAX_ROWS], inv_t[:SPLIT_MAX_ROWS], top_p[:SPLIT_MAX_ROWS],
                                          interpret=True)), want[:SPLIT_MAX_ROWS])


def test_backend_switch_runs_both():
    logits = jnp.asarray(np.random.default_rng(7).normal(size=(2, 300)), jnp.float32)
    a = pallas_kernels.top_p_threshold(logits, 1.0, 0.9)
    b = pallas_kernels.top_p_threshold(logits, 1.0, 0.9, backend="pallas")
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        pallas_kernels.top_p_threshold(logits, 1.0, 0.9, backend="cuda")
