"""lm_head_top (pallas_kernels/lm_head_top.py): a draft head's norm, LM head and top-b picks in one kernel,
in interpret mode against its jnp reference (lax.top_k over the float32 logits), float32, fresh random
inputs: the picks in order, ties to the lower column within and across the kernel's column blocks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.lm_head_top import BLOCK_N, lm_head_top_pallas, lm_head_top_reference


def inputs(key, M: int, K: int, V: int):
    keys = jax.random.split(key, 3)
    x = jax.random.normal(keys[0], (M, K)) * 3.0  # a pre-norm state: the kernel must norm it
    norm = 1.0 + 0.1 * jax.random.normal(keys[1], (K,))
    return x, norm, 0.05 * jax.random.normal(keys[2], (K, V))


@pytest.mark.parametrize("M, K, V, b", [
    (1, 576, 12288, 5),  # SmolLM2's head at the root: its width and draft vocabulary, a 5,3+1 root
    (5, 128, 1000, 3),   # a depth's nodes; a vocabulary that is no multiple of the column block
    (70, 64, 300, 1),    # two row blocks of 64, one pick
])
def test_lm_head_top_equals_reference(M, K, V, b):
    x, norm, w = inputs(jax.random.key(M * 7 + V), M, K, V)
    want = lm_head_top_reference(x, norm, w, b, eps=1e-5)
    got = lm_head_top_pallas(x, norm, w, b, eps=1e-5, interpret=True)
    assert got.shape == (M, b) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    logits = np.asarray(jnp.dot(x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * norm, w))
    np.testing.assert_array_equal(want, np.argsort(-logits, axis=-1, kind="stable")[:, :b])  # the largest, in order
    assert not np.array_equal(got, lm_head_top_pallas(x, -norm, w, b, eps=1e-5, interpret=True))  # its weight counts


def test_lm_head_top_ties_go_to_the_lower_column():
    """Equal logits within a column block and across blocks: the lower column first, as lax.top_k."""
    K, V = 64, 3 * BLOCK_N
    x, norm, w = inputs(jax.random.key(9), 2, K, V)
    best = int(jnp.argmax(jnp.dot(x[0] * norm, w)))
    w = w.at[:, [3, BLOCK_N + 5, 2 * BLOCK_N + 1, 7]].set(w[:, best][:, None] * 2.0)  # four equal best columns
    got = lm_head_top_pallas(x, norm, w, 4, eps=1e-5, interpret=True)
    np.testing.assert_array_equal(got[0], [3, 7, BLOCK_N + 5, 2 * BLOCK_N + 1])
    np.testing.assert_array_equal(got, lm_head_top_reference(x, norm, w, 4, eps=1e-5))


def test_lm_head_top_switch_takes_the_reference_where_the_kernel_does_not_fit():
    x, norm, w = inputs(jax.random.key(10), 3, 72, 200)  # K 72: no whole step of 16
    got = pallas_kernels.lm_head_top(x, norm, w, 2, eps=1e-5, backend="pallas")
    np.testing.assert_array_equal(got, lm_head_top_reference(x, norm, w, 2, eps=1e-5))
