"""Int8 draft weights (`--draft-weights int8`, `models.quantize`): the round trip stays within half a
scale step per column, and bad specs are one-line errors. That drafts reading the int8 copies keep
the output exactly the model's is tested with every other drafter in tests/test_engine.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, quantize


def test_round_trip_within_half_a_step():
    w = jax.random.normal(jax.random.key(0), (3, 96, 40)) * jnp.linspace(0.01, 4.0, 40)  # columns of different scales
    w = w.at[1, :, 7].set(0.0)  # a zero column
    q = quantize.quantize_int8(w)
    assert q.values.dtype == jnp.int8 and q.scale.shape == (3, 40)
    error = np.abs(np.asarray(quantize.dequantize(q), np.float64) - np.asarray(w, np.float64))
    assert (error <= np.asarray(q.scale)[:, None, :] / 2 + 1e-7).all()
    assert np.abs(np.asarray(q.values)).max() == 127 and (np.asarray(q.values)[1, :, 7] == 0).all()
    x = jax.random.normal(jax.random.key(1), (5, 96))
    np.testing.assert_allclose(decoder.matmul(x, jax.tree.map(lambda a: a[2], q)),
                               x @ quantize.dequantize(jax.tree.map(lambda a: a[2], q)), rtol=1e-5, atol=1e-5)


def test_bad_draft_weight_specs():
    with pytest.raises(JaxspecError, match="--draft-weights must be one of"):
        SpecConfig(method="vegas", draft_weights="int3").validate()
    for method in ("plain", "ngram"):
        with pytest.raises(JaxspecError, match="needs a model drafter"):
            SpecConfig(method=method, draft_weights="int8").validate()
    with pytest.raises(JaxspecError, match="carry no draft copies"):
        quantize.draft_params({"layers": {}}, "int8")


def test_the_draft_forward_reads_the_int8_copies():
    """decoder.score with the draft params equals the model whose matrices are the dequantized
    copies, and differs from the exact model (the draft really reads int8 weights)."""
    from jaxspec.models.config import ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, qk_norm=True, dtype="float32")
    params = quantize.with_draft_weights(decoder.init_params(cfg, jax.random.key(2), scale=0.3), "int8")
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size)
    draft = decoder.score(quantize.draft_params(params, "int8"), cfg, tokens)
    dequantized = {**params, "layers": {**params["layers"], **{
        name: quantize.dequantize(q) for name, q in params["draft_layers"].items()}}}
    np.testing.assert_allclose(draft, decoder.score(dequantized, cfg, tokens), rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(draft) - np.asarray(decoder.score(params, cfg, tokens))).max() > 1e-3
    assert quantize.draft_bytes(params) == sum(
        q.values.size + 4 * q.scale.size for q in params["draft_layers"].values())
