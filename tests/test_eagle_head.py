"""The EAGLE-3 head (jaxspec.models.eagle) against a float64 PyTorch reference written here from the
published architecture, and its loader/writer (jaxspec.loaders.eagle) in the public layout."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jaxspec.errors import JaxspecError
from jaxspec.loaders.eagle import build_params, load_eagle, save_eagle
from jaxspec.models import decoder, eagle
from jaxspec.models.config import ModelConfig, RopeConfig

TARGET = ModelConfig(model_type="llama", vocab_size=100, hidden_size=32, num_layers=8, num_heads=2, num_kv_heads=1,
                     head_dim=16, intermediate_size=64, dtype="float32")
# 4 q heads of 16 over 2 KV heads (GQA, q width 64 != hidden 32); features of the target's width
ECFG = eagle.EagleConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48,
                         draft_vocab_size=40, vocab_size=100, target_hidden_size=32, feature_layers=(2, 4, 5),
                         rms_norm_eps=1e-5, rope=RopeConfig(theta=500.0), max_position_embeddings=256)
PUBLIC_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48, "rms_norm_eps": 1e-5, "rope_theta": 500.0,
    "max_position_embeddings": 256, "vocab_size": 100, "draft_vocab_size": 40, "target_hidden_size": 32,
    "num_hidden_layers": 1, "tie_word_embeddings": False, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
}
B, T, START = 2, 7, 3  # rows, sequence length, RoPE position of the first row


def public_weights(seed: int) -> dict[str, torch.Tensor]:
    """Random float64 tensors under the public names, [out, in] as torch's Linear holds them."""
    g = torch.Generator().manual_seed(seed)
    H, F, Dh = ECFG.hidden_size, ECFG.intermediate_size, ECFG.head_dim
    shapes = {
        "fc.weight": (H, 3 * ECFG.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (ECFG.num_heads * Dh, 2 * H),
        "midlayer.self_attn.k_proj.weight": (ECFG.num_kv_heads * Dh, 2 * H),
        "midlayer.self_attn.v_proj.weight": (ECFG.num_kv_heads * Dh, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, ECFG.num_heads * Dh),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (F, H), "midlayer.mlp.up_proj.weight": (F, H),
        "midlayer.mlp.down_proj.weight": (H, F),
        "norm.weight": (H,), "lm_head.weight": (ECFG.draft_vocab_size, H),
    }
    w = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=g, dtype=torch.float64)
        w[name] = 1 + 0.2 * noise if len(shape) == 1 else noise / math.sqrt(shape[1])
    used = torch.sort(torch.randperm(ECFG.vocab_size, generator=g)[:ECFG.draft_vocab_size]).values
    w["d2t"] = used - torch.arange(ECFG.draft_vocab_size)
    w["t2d"] = torch.zeros(ECFG.vocab_size, dtype=torch.bool).index_fill(0, used, True)
    return w


def reference(w, embeds, hidden, positions, window: int = 0):
    """EAGLE-3's head in float64: midlayer (input_layernorm on the embeddings, hidden_norm on the
    hidden input, concatenated; q/k/v with RoPE and GQA; causal attention over the sequence (with
    `window`, over the last `window` positions only); residual with the pre-norm hidden;
    post_attention_layernorm, SwiGLU MLP, residual) -> norm -> lm_head.
    Returns (logits over the draft vocabulary, pre-norm output)."""
    eps, Hq, Hkv, Dh = ECFG.rms_norm_eps, ECFG.num_heads, ECFG.num_kv_heads, ECFG.head_dim
    rms = lambda x, name: w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    lin = lambda x, name: x @ w[name].T
    n, t = embeds.shape[:2]

    def rope(x):  # [n, heads, t, Dh], rotate-half at `positions`
        inv_freq = 1.0 / ECFG.rope.theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
        angles = positions[:, None, :, None].double() * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        x1, x2 = x[..., :Dh // 2], x[..., Dh // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = torch.cat([rms(embeds, "midlayer.input_layernorm.weight"), rms(hidden, "midlayer.hidden_norm.weight")], -1)
    heads = lambda y, h: y.view(n, t, h, Dh).transpose(1, 2)
    q = rope(heads(lin(x, "midlayer.self_attn.q_proj.weight"), Hq))
    k = rope(heads(lin(x, "midlayer.self_attn.k_proj.weight"), Hkv)).repeat_interleave(Hq // Hkv, dim=1)
    v = heads(lin(x, "midlayer.self_attn.v_proj.weight"), Hkv).repeat_interleave(Hq // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    masked = torch.ones(t, t, dtype=torch.bool).triu(1)
    if window:
        masked |= torch.ones(t, t, dtype=torch.bool).tril(-window)
    scores = scores.masked_fill(masked, -torch.inf)
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, t, Hq * Dh)
    h = hidden + lin(attn, "midlayer.self_attn.o_proj.weight")
    m = rms(h, "midlayer.post_attention_layernorm.weight")
    h = h + lin(torch.nn.functional.silu(lin(m, "midlayer.mlp.gate_proj.weight")) * lin(m, "midlayer.mlp.up_proj.weight"),
                "midlayer.mlp.down_proj.weight")
    return lin(rms(h, "norm.weight"), "lm_head.weight"), h


def lin_fc(w, features):
    """fc: the concatenated features projected to the head's width."""
    return features @ w["fc.weight"].T


def inputs(seed: int, t: int = T):
    """Fresh random embeddings [B, t, H], features [B, t, 3 Ht] (float64) and positions [B, t]."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(B, t, ECFG.hidden_size, generator=g, dtype=torch.float64)
    features = torch.randn(B, t, 3 * ECFG.target_hidden_size, generator=g, dtype=torch.float64)
    positions = START + torch.arange(t).repeat(B, 1)
    return embeds, features, positions


def jax_params(w):
    """The head's params from the public tensors, on the device (as `load_model` puts a model's)."""
    return jax.device_put(build_params(ECFG, {n: x.numpy() for n, x in w.items()}, np.float32, "test"))


f32 = lambda x: jnp.asarray(x.numpy(), jnp.float32)


@jax.jit
def run_head(params, cache, embeds, hidden, positions, slots):
    """The head over rows at RoPE `positions` and cache `slots`: (draft logits, pre-norm output, cache)."""
    out, cache = eagle.head_forward(params, ECFG, embeds, hidden, positions, jnp.ones(positions.shape, bool), cache,
                                    slots=slots)
    return eagle.draft_logits(params, ECFG, None, None, out), out, cache


def jax_prefill(params, embeds, hidden, positions):
    """Draft logits of the whole sequence in one pass, cache slots 0.. while RoPE positions start at START."""
    slots = jnp.broadcast_to(jnp.arange(positions.shape[1], dtype=jnp.int32), positions.shape)
    logits, _, _ = run_head(params, eagle.init_cache(ECFG, B, 32, "float32"), embeds, hidden,
                            jnp.asarray(positions.numpy(), jnp.int32), slots)
    return logits


def test_head_matches_the_float64_reference_as_prefill_and_as_steps():
    w = public_weights(0)
    embeds, features, positions = inputs(1)
    want, want_prenorm = reference(w, embeds, lin_fc(w, features), positions)
    params = jax_params(w)
    hidden = eagle.project_features(params, f32(features))
    np.testing.assert_allclose(hidden, lin_fc(w, features).numpy(), rtol=1e-5, atol=1e-5)

    np.testing.assert_allclose(jax_prefill(params, f32(embeds), hidden, positions), want.numpy(), rtol=1e-5, atol=1e-5)

    cache = eagle.init_cache(ECFG, B, 32, "float32")
    for t in range(T):
        pos = jnp.asarray(positions[:, t:t + 1].numpy(), jnp.int32)
        logits, out, cache = run_head(params, cache, f32(embeds[:, t:t + 1]), hidden[:, t:t + 1], pos,
                                      jnp.full((B, 1), t, jnp.int32))
        np.testing.assert_allclose(logits, want[:, t:t + 1].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out, want_prenorm[:, t:t + 1].numpy(), rtol=1e-5, atol=1e-5)

    # a draft step feeds the head's own pre-norm output back in place of the projected feature
    next_embed = inputs(2, 1)[0]
    fed_back = torch.cat([lin_fc(w, features), want_prenorm[:, -1:]], 1)
    want_next, _ = reference(w, torch.cat([embeds, next_embed], 1), fed_back, START + torch.arange(T + 1).repeat(B, 1))
    pos = jnp.full((B, 1), START + T, jnp.int32)
    logits, _, _ = run_head(params, cache, f32(next_embed), out, pos, jnp.full((B, 1), T, jnp.int32))
    np.testing.assert_allclose(logits, want_next[:, -1:].numpy(), rtol=1e-5, atol=1e-5)


def test_a_sliding_window_head_attends_its_last_keys_only():
    """`EagleConfig.sliding_window` W: a row sees the keys of its last W positions (a sequence from
    position 0, each key at the slot of its position, as inference keeps them), as the float64
    reference with that window; the window bites (the whole-sequence output differs), and a window of
    the sequence's length changes nothing."""
    w = public_weights(21)
    embeds, features, positions = inputs(22)
    positions = positions - START
    params = jax_params(w)
    hidden = eagle.project_features(params, f32(features))
    pos = jnp.asarray(positions.numpy(), jnp.int32)
    for window in (3, T):
        ecfg = dataclasses.replace(ECFG, sliding_window=window)
        out, _ = eagle.head_forward(params, ecfg, f32(embeds), hidden, pos, jnp.ones(pos.shape, bool),
                                    eagle.init_cache(ecfg, B, 32, "float32"))
        want = reference(w, embeds, lin_fc(w, features), positions, window)[1]
        np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-5)
    whole = reference(w, embeds, lin_fc(w, features), positions)[1]
    assert (reference(w, embeds, lin_fc(w, features), positions, 3)[1] - whole).abs().max() > 1e-3
    np.testing.assert_allclose(out, whole.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_pallas_backend_matches_the_reference():
    """The head runs the decoder's kernels behind the backend switch, with and without a window
    (Pallas interpreted on the CPU: ~15 s, so with the slow tests; the kernels themselves are tested
    in test_kernels_*)."""
    params = jax_params(public_weights(13))
    embeds, features, positions = inputs(14, 4)
    pos = jnp.asarray(positions.numpy(), jnp.int32)
    # the matrices the row kernel reads in place at these shapes (the rest stay XLA's products)
    in_place = [name for name in ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")
                if isinstance(decoder.row_kernel_matrix(params[name], f32(embeds), "pallas"), decoder.InPlace)]
    assert {"fc", "wqkv", "w_gate_up"} <= set(in_place)
    for ecfg in (ECFG, dataclasses.replace(ECFG, sliding_window=2)):
        outs = []
        for backend in ("reference", "pallas"):
            hidden = eagle.project_features(params, f32(features), backend)
            cache = eagle.init_cache(ecfg, B, 16, "float32")
            out, cache = eagle.head_forward(params, ecfg, f32(embeds), hidden, pos, jnp.ones(pos.shape, bool), cache,
                                            backend=backend)
            step, _ = eagle.head_forward(params, ecfg, f32(embeds[:, :1]), out[:, -1:], pos[:, -1:] + 1,
                                         jnp.ones((B, 1), bool), cache, backend=backend)
            outs.append((hidden, out, step, eagle.draft_logits(params, ecfg, None, None, out, backend)))
        for want, got in zip(*outs):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_draft_ids_and_the_target_distribution():
    params = eagle.init_params(jax.random.key(3), ECFG, jnp.float32)
    d2t = params["d2t"]
    targets = np.asarray(eagle.to_target_ids(d2t, jnp.arange(ECFG.draft_vocab_size)))
    assert len(set(targets)) == ECFG.draft_vocab_size and targets.min() >= 0 and targets.max() < ECFG.vocab_size
    rng = np.random.default_rng(4)
    draft_ids = rng.integers(0, ECFG.draft_vocab_size, (B, 5))
    np.testing.assert_array_equal(eagle.to_target_ids(d2t, draft_ids), targets[draft_ids])

    logits = 3 * rng.standard_normal((B, 3, ECFG.draft_vocab_size), np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    q = np.asarray(eagle.to_target_probs(d2t, probs, ECFG.vocab_size))
    t2d = np.zeros(ECFG.vocab_size, bool)
    t2d[targets] = True
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-6)
    assert (q[..., ~t2d] == 0).all()
    np.testing.assert_array_equal(q[..., targets], probs)


def write_public(path, w, config=None, dtype=torch.float32, bin_file=False, drop=(), replace=None):
    """A head in the public layout, written with torch/safetensors directly."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or PUBLIC_CONFIG))
    tensors = {n: (x.to(dtype) if x.is_floating_point() else x).contiguous() for n, x in w.items() if n not in drop}
    tensors.update(replace or {})
    if bin_file:
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("bin_file", [False, True], ids=["safetensors", "pytorch_bin"])
def test_loader_reads_the_public_layout(tmp_path, bin_file):
    w = public_weights(6)
    ecfg, params = load_eagle(write_public(tmp_path / "head", w, bin_file=bin_file), TARGET, "float32")
    assert ecfg == ECFG
    params = jax.device_put(params)
    embeds, features, positions = inputs(7)
    want, _ = reference(w, embeds, lin_fc(w, features), positions)
    logits = jax_prefill(params, f32(embeds), eagle.project_features(params, f32(features)), positions)
    np.testing.assert_allclose(logits, want.numpy(), rtol=1e-5, atol=1e-5)


def test_loader_defaults_and_own_embedding(tmp_path):
    """Without head_dim, target_hidden_size or layer ids the defaults apply; a head with its own
    embedding may be narrower than the target."""
    w = public_weights(8)
    config = {k: v for k, v in PUBLIC_CONFIG.items()
              if k not in ("head_dim", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "num_attention_heads")}
    config["num_attention_heads"] = 2  # head_dim 32 // 2 = 16, yet the target's 16: fits
    ecfg, _ = load_eagle(write_public(tmp_path / "d", {**w, **wide_q(w, 2)}, config=config), TARGET, "float32")
    assert (ecfg.head_dim, ecfg.target_hidden_size, ecfg.feature_layers) == (16, 32, eagle.default_feature_layers(8))
    embed = torch.randn(ECFG.vocab_size, ECFG.hidden_size, dtype=torch.float64)
    _, params = load_eagle(write_public(tmp_path / "e", {**w, "embed_tokens.weight": embed}), TARGET, "float32")
    np.testing.assert_array_equal(params["embed"], embed.float().numpy())


def wide_q(w, heads):
    """q and o projections for `heads` query heads (kv heads unchanged)."""
    g = torch.Generator().manual_seed(9)
    q_dim = heads * ECFG.head_dim
    return {"midlayer.self_attn.q_proj.weight": torch.randn(q_dim, 2 * ECFG.hidden_size, generator=g, dtype=torch.float64),
            "midlayer.self_attn.o_proj.weight": torch.randn(ECFG.hidden_size, q_dim, generator=g, dtype=torch.float64)}


BAD_HEADS = {
    # name: (config changes, tensors dropped, tensors replaced, words of the message)
    "target_hidden": ({"target_hidden_size": 48}, (), {}, "target_hidden_size 48 does not fit the target's hidden size 32"),
    "hidden_no_embed": ({"hidden_size": 40}, (), {}, "hidden_size 40 does not fit the target's hidden size 32"),
    "vocab": ({"vocab_size": 99}, (), {}, "vocab_size 99 does not fit the target's vocabulary size 100"),
    "head_dim": ({"head_dim": 8}, (), {}, "head_dim 8 does not fit the target's head_dim 16"),
    "layers": ({"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, (), {}, "are not three layers of the target's 8"),
    "missing": ({}, ("midlayer.mlp.up_proj.weight",), {}, "has no tensor midlayer.mlp.up_proj.weight"),
    "shape": ({}, (), {"lm_head.weight": torch.ones(41, 32)}, "tensor lm_head.weight has shape (41, 32), expected (40, 32)"),
    "extra": ({}, (), {"midlayer2.fc.weight": torch.ones(2)}, "unexpected tensor midlayer2.fc.weight"),
    "d2t": ({}, (), {"d2t": torch.full((40,), 99)}, "d2t maps draft ids outside the target vocabulary 0..99"),
    "t2d": ({}, (), {"t2d": torch.ones(100, dtype=torch.bool)}, "t2d does not mark exactly the d2t target ids"),
    "two_layers": ({"num_hidden_layers": 2}, (), {}, "num_hidden_layers 2 is not supported"),
    "no_lm_head": ({}, ("lm_head.weight",), {}, "has no tensor lm_head.weight (a head without one drafts through the "
                   "target's LM head, so its draft_vocab_size must be vocab_size 100)"),
    "whole_vocab_permuted": ({"draft_vocab_size": 100}, (), {
        "lm_head.weight": torch.ones(100, 32), "t2d": torch.ones(100, dtype=torch.bool),
        "d2t": torch.arange(99, -1, -1) - torch.arange(100)}, "its draft vocabulary is the whole vocabulary, but d2t"),
}


@pytest.mark.parametrize("name", BAD_HEADS)
def test_bad_heads_are_one_line_errors(tmp_path, name):
    changes, drop, replace, words = BAD_HEADS[name]
    path = write_public(tmp_path / name, public_weights(10), config={**PUBLIC_CONFIG, **changes}, drop=drop,
                        replace=replace)
    with pytest.raises(JaxspecError, match=re.escape(words)) as e:
        load_eagle(path, TARGET, "float32")
    assert "\n" not in str(e.value)


def test_unreadable_heads_are_one_line_errors(tmp_path):
    path = write_public(tmp_path / "corrupt", public_weights(11))
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    for broken, words in ((path, "corrupt or unreadable safetensors file"), (tmp_path / "none", "is not a directory")):
        with pytest.raises(JaxspecError, match=words) as e:
            load_eagle(broken, TARGET, "float32")
        assert "\n" not in str(e.value)
    (path / "model.safetensors").unlink()
    with pytest.raises(JaxspecError, match="has no model.safetensors or pytorch_model.bin"):
        load_eagle(path, TARGET, "float32")
    (path / "config.json").write_text("{")
    with pytest.raises(JaxspecError, match="cannot read EAGLE head config"):
        load_eagle(path, TARGET, "float32")
    for config, words in (([], "is not a JSON object"), ({**PUBLIC_CONFIG, "num_attention_heads": 0, "head_dim": None},
                                                          "has a bad value")):
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(JaxspecError, match=words):
            load_eagle(path, TARGET, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_exact(tmp_path, dtype):
    params = eagle.init_params(jax.random.key(12), ECFG, jnp.dtype(dtype).name)
    save_eagle(tmp_path / "head", ECFG, params)
    ecfg, loaded = load_eagle(tmp_path / "head", TARGET, dtype)
    assert ecfg == ECFG and loaded.keys() == params.keys()
    for name in params:
        assert loaded[name].dtype == params[name].dtype, name
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(params[name]), err_msg=name)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40


def shared_head_weights(seed: int) -> dict[str, torch.Tensor]:
    """A head that shares the target's LM head: the public tensors without lm_head.weight, its draft
    vocabulary the whole vocabulary (d2t zeros, t2d all true)."""
    w = public_weights(seed)
    del w["lm_head.weight"]
    V = ECFG.vocab_size
    return {**w, "d2t": torch.zeros(V, dtype=torch.int64), "t2d": torch.ones(V, dtype=torch.bool)}


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied_embedding"])
def test_a_head_without_an_lm_head_drafts_through_the_targets(tmp_path, tied):
    """No lm_head.weight: the head's logits are its final norm through the target's LM head (or the
    tied embedding) over the whole vocabulary, against the float64 reference with that matrix; it
    writes and reloads exactly, without an LM head of its own."""
    w = shared_head_weights(15)
    path = write_public(tmp_path / "head", w, config={**PUBLIC_CONFIG, "draft_vocab_size": 100})
    ecfg, params = load_eagle(path, TARGET, "float32")
    assert ecfg == dataclasses.replace(ECFG, draft_vocab_size=100, shared_lm_head=True) and "lm_head" not in params
    table = torch.randn(ECFG.vocab_size, ECFG.hidden_size, dtype=torch.float64) / math.sqrt(ECFG.hidden_size)
    target = {"embed": f32(table)} if tied else {"embed": f32(torch.randn_like(table)), "lm_head": f32(table.T)}
    params = jax.device_put(params)
    embeds, features, positions = inputs(16)
    want, _ = reference({**w, "lm_head.weight": table}, embeds, lin_fc(w, features), positions)
    pos = jnp.asarray(positions.numpy(), jnp.int32)
    slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), pos.shape)  # as jax_prefill places them
    out, _ = eagle.head_forward(params, ecfg, f32(embeds), eagle.project_features(params, f32(features)), pos,
                                jnp.ones(pos.shape, bool), eagle.init_cache(ecfg, B, 32, "float32"), slots=slots)
    logits = eagle.draft_logits(params, ecfg, target, TARGET, out)
    np.testing.assert_allclose(logits, want.numpy(), rtol=1e-5, atol=1e-5)

    save_eagle(tmp_path / "again", ecfg, params)
    assert "lm_head.weight" not in load_names(tmp_path / "again")
    again_cfg, again = load_eagle(tmp_path / "again", TARGET, "float32")
    assert again_cfg == ecfg and again.keys() == params.keys()
    for name in params:
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(params[name]), err_msg=name)
    probs = jax.nn.softmax(jnp.asarray(np.random.default_rng().normal(size=(B, 3, 100)), jnp.float32))
    np.testing.assert_array_equal(eagle.to_target_probs(again["d2t"], probs, 100), probs)  # q is its distribution


def load_names(path) -> list[str]:
    """The tensor names of a written head's model.safetensors."""
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="numpy") as f:
        return list(f.keys())
