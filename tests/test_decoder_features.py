"""`decoder.forward(..., capture=layers)`: the residual stream entering chosen layers (EAGLE-3's
features) equals transformers' `output_hidden_states[i]`, over a prefill and over cached one-token
steps; without `capture` the program is unchanged, and with it each layer keeps its own inputs and
outputs; a draft's skipped layer cannot be captured."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import _model, _randomize
from jaxspec.errors import JaxspecError
from jaxspec.loaders.hf import build_params
from jaxspec.models import decoder
from jaxspec.models.config import ModelConfig
from jaxspec.models.kvcache import init_cache
from test_loaders import relative_error

LAYERS = 7
CAPTURE = {"llama": (2, LAYERS // 2, LAYERS - 3), "qwen3": (5, 0, 3)}  # EAGLE-3's default; any order


@functools.cache
def twin(kind: str):
    """(cfg, params, transformers model) of one random 7-layer model, built the way conftest's
    `hf_checkpoints` builds its models."""
    model = _model(kind, num_hidden_layers=LAYERS)
    _randomize(model, seed=LAYERS)
    cfg = ModelConfig.from_hf(model.config.to_dict(), dtype="float32")
    weights = {name: w.numpy() for name, w in model.state_dict().items()}
    return cfg, jax.tree.map(jnp.asarray, build_params(cfg, weights.__getitem__)), model.eval()


def run(params, tokens, positions, cache, cfg, **kw):
    """`forward` over `tokens` [B, T] at `positions` (cached: the keys written before are read)."""
    attend = decoder.attention(cfg, positions, "reference")
    return decoder.forward(params, cfg, tokens, positions, jnp.ones(tokens.shape, bool), cache, attend, **kw)


def hidden_states(model, tokens: np.ndarray, layers: tuple[int, ...]) -> np.ndarray:
    """transformers' hidden_states[i] of `layers`, concatenated along the features: [B, T, n * D]."""
    import torch

    with torch.no_grad():
        states = model(torch.from_numpy(tokens), output_hidden_states=True).hidden_states
    return np.concatenate([states[i].numpy() for i in layers], axis=-1)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_features_match_transformers_hidden_states(kind):
    cfg, params, model = twin(kind)
    capture = CAPTURE[kind]
    B, T, prefill = 2, 12, 8
    tokens = np.random.default_rng(len(kind)).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    step = jax.jit(functools.partial(run, cfg=cfg, capture=capture))
    expected = hidden_states(model, tokens, capture)

    *_, features = step(params, jnp.asarray(tokens), positions, init_cache(cfg, B, 16))
    assert features.shape == (B, T, len(capture) * cfg.hidden_size)
    assert relative_error(features, expected) <= 1e-4

    _, cache, _, first = step(params, jnp.asarray(tokens[:, :prefill]), positions[:, :prefill], init_cache(cfg, B, 16))
    rows = [first]
    for t in range(prefill, T):  # one token at a time, reading the cache
        _, cache, _, row = step(params, jnp.asarray(tokens[:, t:t + 1]), positions[:, t:t + 1], cache)
        rows.append(row)
    assert relative_error(jnp.concatenate(rows, axis=1), expected) <= 1e-4


def test_program_without_capture_is_unchanged():
    cfg, params, _ = twin("llama")
    tokens, positions = jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 5, jnp.int32)
    lowered = lambda **kw: jax.jit(functools.partial(run, cfg=cfg, **kw)).lower(
        params, tokens, positions, init_cache(cfg, 2, 16)).as_text()
    default = lowered()
    assert lowered(capture=()) == default
    assert lowered(capture=(2,)) != default


def test_capture_keeps_per_layer_inputs_and_outputs():
    """With capture the layers run as several scans: each layer still reads its own `layer_xs` and
    returns its own output, stacked in layer order, and the stream leaving the last layer is unchanged."""
    cfg, params, _ = twin("qwen3")
    rng = np.random.default_rng(11)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)).astype(np.int32))
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    base = decoder.attention(cfg, positions, "reference")

    def attend(layer, q, cache, lx, gates, carry):  # a per-layer output that depends on the layer's input
        out, _, carry = base(layer, q, cache, lx, gates, carry)
        return out, jnp.sum(q, axis=(2, 3)) * lx, carry

    layer_xs = jnp.asarray(rng.normal(size=LAYERS).astype(np.float32))
    step = lambda **kw: decoder.forward(params, cfg, tokens, positions, jnp.ones(tokens.shape, bool),
                                        init_cache(cfg, 2, 8), attend, layer_xs, **kw)
    x, _, ys = step()
    x_c, _, ys_c, _ = step(capture=CAPTURE["qwen3"])
    assert ys.shape == (LAYERS, 2, 5)
    np.testing.assert_allclose(ys_c, ys, rtol=1e-6)
    np.testing.assert_allclose(x_c, x, rtol=1e-6)


def test_skipped_or_repeated_layer_cannot_be_captured():
    cfg, params, model = twin("llama")
    kept = np.array([0, 1, 2, 4, 5, 6])  # a draft that skips layer 3: its stack holds the kept layers
    draft = {**params, "layers": jax.tree.map(lambda a: a[kept], params["layers"])}
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 4)).astype(np.int32)
    tokens, positions = jnp.asarray(ids), jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (1, 4))
    # capture names model layers: layer 4's input in the draft is what enters layer 3 in the model
    features = run(draft, tokens, positions, init_cache(cfg, 1, 8), cfg, layer_ids=kept, capture=(4, 0))[3]
    assert relative_error(features, hidden_states(model, ids, (3, 0))) <= 1e-4
    for capture, message in (((2, 3), "capture: layer 3 is not one of this forward's layers [0, 1, 2, 4, 5, 6]"),
                             ((7,), "capture: layer 7 is not one of"), ((4, 4), "capture: layer 4 is given twice")):
        with pytest.raises(JaxspecError, match=r"^[^\n]*$") as error:
            run(draft, tokens, positions, init_cache(cfg, 1, 8), cfg, layer_ids=kept, capture=capture)
        assert str(error.value).startswith(message)
