"""select_topk: the radix-select Pallas kernel (interpret mode) and the lax.top_k reference against
a NumPy sort. Both must return, per row, the slots of the min(k, #finite) largest scores first
(as a set, ties arbitrary) and only slots in [0, S) after them.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk import select_topk_pallas, select_topk_reference


def assert_topk(idx, scores, k_max, k):
    idx = np.asarray(idx).reshape(-1, k_max)
    k = np.broadcast_to(np.asarray(k), scores.shape[:-1]).reshape(-1)
    scores = np.asarray(scores).reshape(-1, scores.shape[-1])
    assert ((idx >= 0) & (idx < scores.shape[1])).all()
    for row, (got, x, kr) in enumerate(zip(idx, scores, k)):
        n = min(kr, np.isfinite(x).sum())
        assert len(set(got[:kr])) == kr, f"row {row}: repeated slots"
        np.testing.assert_array_equal(np.sort(x[got[:n]]), np.sort(x)[::-1][:n][::-1],
                                      err_msg=f"row {row}")


def scores_with_ties_and_holes(seed, shape):
    """Normal scores with -inf holes, exact ties, +-0.0 and huge magnitudes."""
    key_x, key_hole = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(key_x, shape) * 3.0
    x = jnp.where(jax.random.uniform(key_hole, shape) < 0.2, -jnp.inf, x)
    x = x.at[..., :40].set(jnp.round(x[..., :40]))
    x = x.at[..., 40:44].set(jnp.array([0.0, -0.0, 3e38, -3e38]))
    return x.at[0, ..., 300:].set(-jnp.inf)


CASES = [
    # (shape, k_max, k, chunk)
    ((3, 2, 1000), 100, np.array([[1, 100], [50, 99], [7, 64]]), 256),
    ((2, 600), 600, np.array([600, 300]), 128),     # k above the number of finite scores
    ((4, 256), 256, np.array(256), 2048),           # whole row, one chunk
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_select_topk(case):
    shape, k_max, k, chunk = CASES[case]
    scores = scores_with_ties_and_holes(300 + case, shape)
    ref = select_topk_reference(scores, k_max, k)
    assert_topk(ref, scores, k_max, k)
    got = jax.jit(lambda s, k: select_topk_pallas(s, k_max, k, interpret=True, chunk=chunk))(
        scores, jnp.asarray(k, jnp.int32))
    assert got.shape == (*shape[:-1], k_max) and got.dtype == jnp.int32
    assert_topk(got, scores, k_max, k)


def test_select_topk_rejects_bad_k_max():
    with pytest.raises(ValueError, match="k_max"):
        select_topk_reference(jnp.zeros((2, 8)), 9, 1)
