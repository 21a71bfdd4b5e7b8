"""residual_norm (pallas_kernels/residual_norm.py): the residual add + RMSNorm kernel in interpret mode
against its jnp reference, float32, fresh random inputs, at widths that are and are not powers of two."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.residual_norm import residual_norm_pallas, residual_norm_reference


@pytest.mark.parametrize("M, D, splits, scale", [
    (1, 576, 1, True),     # SmolLM2's width (not a power of two), an int8 draft step
    (7, 64, 3, True),      # split sums
    (5, 96, 1, False),     # an exact product
])
def test_residual_norm_equals_reference(M, D, splits, scale):
    keys = jax.random.split(jax.random.key(M * 1000 + D), 5)
    E = 3
    x = jax.random.normal(keys[0], (M, D))
    sums = jax.random.normal(keys[1], (splits, M + 4, D))  # rows past M: never read
    weight = 1.0 + 0.1 * jax.random.normal(keys[2], (E, D))
    col_scale = jax.random.uniform(keys[3], (E, D), minval=0.5, maxval=2.0) if scale else None
    want = residual_norm_reference(x, sums, weight, jnp.int32(2), eps=1e-5, scale=col_scale)
    got = residual_norm_pallas(x, sums, weight, jnp.int32(2), eps=1e-5, scale=col_scale, interpret=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (M, D)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got[0], x)  # the product was added
