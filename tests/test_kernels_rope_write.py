"""rope_write (pallas_kernels/rope_write.py): the q/k/v epilogue kernel in interpret mode against its
jnp reference, float32, on fresh random inputs and pools full of random values (rows' pages scattered,
the other pages poisoned), so that an entry the kernel writes wrongly, or one it should not write, shows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paging
from pallas_kernels.rope_write import rope_write_pallas, rope_write_reference
from paged_pools import scatter

SLOTS, PAGE = 128, 64


@pytest.mark.parametrize("B, T, Hq, Hkv, Dh, splits, scale, bias, qk_norm", [
    (1, 1, 9, 3, 64, 1, True, False, False),    # SmolLM2's heads, an int8 draft step
    (2, 3, 4, 2, 16, 3, True, True, True),      # split sums, bias and qk-norm together
    (3, 7, 8, 2, 32, 1, False, False, True),    # an exact product, verification rows
    (1, 1, 32, 2, 64, 4, False, False, False),  # a 1.2B Llama's 16 q heads a KV head, its capped splits
])
def test_rope_write_equals_reference(B, T, Hq, Hkv, Dh, splits, scale, bias, qk_norm):
    keys = jax.random.split(jax.random.key(B * 100 + T), 9)
    L, E, N = 3, 2, (Hq + 2 * Hkv) * Dh + 6  # 6 columns past v (an NSA model's gates): never read
    sums = jax.random.normal(keys[0], (splits, B * T + 5, N))  # rows past B*T: never read
    positions = jax.random.randint(keys[1], (B, T), 0, 4096)
    write_pos = jax.random.permutation(keys[2], SLOTS)[:B * T].reshape(B, T)
    if B * T > 1:
        write_pos = write_pos.at[B - 1, T - 1].set(SLOTS)  # an invalid token: past the end, into the null page
    (k_pool, v_pool), pages = scatter([jax.random.normal(k, (L, B, Hkv, SLOTS, Dh)) for k in keys[3:5]],
                                      PAGE, B * 100 + T)
    write_slots = paging.physical(pages, write_pos, PAGE)
    options = dict(
        scale=jax.random.uniform(keys[5], (E, N), minval=0.5, maxval=2.0) if scale else None,
        bias=jax.random.normal(keys[6], (E, N)) if bias else None,
        q_norm=jax.random.normal(keys[7], (E, Dh)) if qk_norm else None,
        k_norm=jax.random.normal(keys[8], (E, Dh)) if qk_norm else None)
    inv_freq = (1.0 / 1e4 ** (np.arange(0, Dh, 2) / Dh)).astype(np.float32)
    args = (sums, positions, write_slots, k_pool, v_pool, jnp.int32(1), jnp.int32(2), inv_freq)
    kw = dict(num_heads=Hq, rope_scale=1.25, eps=1e-6, **options)
    # under jit: one compile each (eagerly, every op of the reference and the interpreted kernel compiles on its own)
    want = jax.jit(lambda *a: rope_write_reference(*a, page_size=PAGE, **kw))(*args)
    got = jax.jit(lambda *a: rope_write_pallas(*a, interpret=True, **kw))(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    null = np.arange(k_pool.shape[2]) // PAGE == paging.NULL_PAGE  # where the invalid token's slot is
    assert (np.asarray(write_slots) < PAGE).sum() == (B * T > 1)
    written = np.zeros(k_pool.shape[:3], bool)
    written[2, :, np.asarray(write_slots).ravel()] = True
    written = written[:, :, ~null]
    for got_pool, want_pool, before in zip(got[1:], want[1:], (k_pool, v_pool)):
        g, w, b = (np.asarray(x)[:, :, ~null] for x in (got_pool, want_pool, before))  # outside the null page
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert not np.allclose(g[written], b[written])
        np.testing.assert_array_equal(g[~written], b[~written])
        # the reference drops the invalid token's write (the kernel writes the null page, which nothing reads)
        np.testing.assert_array_equal(np.asarray(want_pool)[:, :, null], np.asarray(before)[:, :, null])