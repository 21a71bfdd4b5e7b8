"""Mixture-of-experts models (Qwen3-MoE): routing against numpy, logits and greedy tokens against
transformers' Qwen3MoeForCausalLM (float32, a tiny random checkpoint saved with save_pretrained in
the released per-expert layout), every drafter lossless on a random MoE model, and the
configurations refused in one line."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import engine
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.loaders import load_model
from jaxspec.models import decoder, eagle, moe, sharding
from jaxspec.models.config import ModelConfig, MoEConfig

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=32, intermediate_size=256, qk_norm=True, dtype="float32",
                  moe=MoEConfig(num_experts=8, top_k=2, expert_size=64, norm_topk_prob=True))
STOP = jnp.array([-1], jnp.int32)


@pytest.mark.parametrize("router, norm", [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)])
def test_route_is_the_routers_rule(router, norm):
    """Qwen3-MoE: softmax over all experts, the top k, renormalised when norm_topk_prob; gpt-oss: the
    top k logits (with the router's bias, its stack's entry), softmaxed over those k. The router is [E, D], as
    checkpoints hold it."""
    rng = np.random.default_rng(5)
    cfg = MoEConfig(num_experts=16, top_k=4, expert_size=8, router=router, norm_topk_prob=norm)
    h, router_w, bias = rng.standard_normal((3, 5, 32)), rng.standard_normal((16, 32)), rng.standard_normal((3, 16))
    ids, weights = moe.route(cfg, jnp.asarray(h, jnp.float32), jnp.asarray(router_w, jnp.float32),
                             jnp.asarray(bias, jnp.float32) if router == "topk_softmax" else None, jnp.int32(2))
    logits = h.reshape(-1, 32) @ router_w.T + (bias[2] if router == "topk_softmax" else 0)
    want_ids = np.argsort(-logits, axis=-1)[:, :4]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    top = np.take_along_axis(logits, want_ids, axis=-1)
    if router == "topk_softmax":
        want = np.exp(top - top.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
    else:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want = np.take_along_axis(probs, want_ids, axis=-1)
        want = want / want.sum(-1, keepdims=True) if norm else want
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5, atol=1e-6)


def test_greedy_tokens_equal_transformers(hf_checkpoints):
    """The shipped engine's plain decoding of the saved checkpoint against transformers' greedy
    generate on the same weights (logits: test_loaders' parity test)."""
    import torch
    import transformers

    path = hf_checkpoints["qwen3_moe"]
    cfg, params, _ = load_model(str(path), "float32")
    assert cfg.moe == MoEConfig(num_experts=8, top_k=2, expert_size=48, norm_topk_prob=True)
    prompt = np.random.default_rng(3).integers(1, cfg.vocab_size, (1, 19))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.from_numpy(prompt), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 19:].tolist()
    out = jax.jit(engine.Engine(cfg, SpecConfig(), SamplingConfig(), 40).generate)(
        params, jnp.asarray(prompt, jnp.int32), jnp.asarray([19], jnp.int32), jax.random.key(0), max_new_tokens=16,
        stop_ids=STOP)
    assert np.asarray(out.tokens)[0, 19:35].tolist() == want


GPT_OSS_MOE = MoEConfig(num_experts=8, top_k=2, expert_size=64, router="topk_softmax", norm_topk_prob=False,
                        activation="gpt_oss", bias=True)


@pytest.mark.parametrize("moe_cfg", [CFG.moe, dataclasses.replace(CFG.moe, norm_topk_prob=False), GPT_OSS_MOE],
                         ids=["qwen3", "qwen3 unnormed", "gpt-oss"])
@pytest.mark.parametrize("T", [1, 5])
def test_moe_layer_kernels_equal_reference(moe_cfg, T):
    """The MoE layer through its kernels (the router's choice, the experts; interpret mode) at a decode
    step's row and at a verify pass's rows: the references' experts, weights and output."""
    cfg = dataclasses.replace(CFG, moe=moe_cfg)
    layers = decoder.init_params(cfg, jax.random.key(40 + T), scale=0.08)["layers"]
    p = {"router": layers["router"][1]}
    stacks = {name: a for name, a in layers.items() if name in moe.STACKS}
    h = jax.random.normal(jax.random.key(50 + T), (2, T, cfg.hidden_size), jnp.float32)
    routes = [moe.route(moe_cfg, h, p["router"], stacks.get("router_bias"), jnp.int32(1), backend)
              for backend in ("reference", "pallas")]
    np.testing.assert_array_equal(routes[0][0], routes[1][0])
    np.testing.assert_allclose(routes[0][1], routes[1][1], rtol=1e-6, atol=1e-7)
    want, got = (moe.experts(cfg, h, p, stacks, jnp.int32(1), backend) for backend in ("reference", "pallas"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def random_model(cfg: ModelConfig, seed: int, lengths: list[int]):
    """(random params of `cfg`, random prompts [B, max(lengths)] of `lengths`, plain decoding's greedy
    tokens of them): what a drafter's output must equal."""
    params = decoder.init_params(cfg, jax.random.key(seed), scale=0.08)
    rng = np.random.default_rng(seed + 1)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(0, cfg.vocab_size, n)
    return params, ids, lengths, greedy(cfg, params, SpecConfig(), ids, lengths)


def greedy(cfg: ModelConfig, params, spec: SpecConfig, ids, lengths, max_new=24) -> list[list[int]]:
    """Each row's greedy tokens under `spec` (`Engine.generate`)."""
    out = jax.jit(engine.Engine(cfg, spec.validate(), SamplingConfig(), max(lengths) + max_new).generate)(
        params, jnp.asarray(ids), jnp.asarray(lengths, jnp.int32), jax.random.key(0), max_new_tokens=max_new,
        stop_ids=STOP)
    tokens, length = jax.device_get((out.tokens, out.length))
    return [tokens[b, n:length[b]].tolist() for b, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def moe_model():
    return random_model(CFG, 7, [300, 37, 120])


# The MoE layer is the same in every draft and verify pass: a chain and a tree cover its rows in the
# default run; the other drafters differ only in attention (tested on dense models), so they are slow.
@pytest.mark.parametrize("spec", [
    SpecConfig(method="vegas", gamma=4, ratio=0.1, min_tokens=16),
    pytest.param(SpecConfig(method="stream", gamma=4, ratio=0.1, min_tokens=16), marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="quest", gamma=4, ratio=0.1, min_tokens=16), marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="ngram", gamma=4), marks=pytest.mark.slow),
    SpecConfig(method="vegas", tree=(3, 2, 1), ratio=0.1, min_tokens=16),
], ids=["vegas", "stream", "quest", "ngram", "vegas tree"])
def test_every_drafter_equals_plain(moe_model, spec):
    params, ids, lengths, plain = moe_model
    assert greedy(CFG, params, spec, ids, lengths) == plain


@pytest.mark.slow  # the head's features are the residual stream, the same for any MLP
def test_eagle_equals_plain(moe_model):
    from test_eagle_engine import head_config

    params, ids, lengths, plain = moe_model
    ecfg = head_config(CFG, draft_vocab=384, layers=(0, 2, 3))
    head = eagle.init_params(jax.random.key(9), ecfg, jnp.float32, 0.05)
    spec = SpecConfig(method="eagle", tree=(3, 2, 1), eagle=ecfg)
    assert greedy(CFG, {**params, "eagle": head}, spec, ids, lengths) == plain


def test_refused_in_one_line(tmp_path):
    hf = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 48, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    assert ModelConfig.from_hf(hf, "float32").moe == MoEConfig(4, 2, 16, norm_topk_prob=False)
    with pytest.raises(JaxspecError, match="mixing dense and MoE layers"):
        ModelConfig.from_hf({**hf, "mlp_only_layers": [0]})
    with pytest.raises(JaxspecError, match="mixing dense and MoE layers"):
        ModelConfig.from_hf({**hf, "decoder_sparse_step": 2})
    with pytest.raises(JaxspecError, match="between 1 and num_experts"):
        ModelConfig.from_hf({**hf, "num_experts_per_tok": 5})
    sharding.check(CFG, 2)  # tensor parallelism: every expert's columns split (test_tensor_parallel)
    with pytest.raises(JaxspecError, match="^--tp 2 does not divide the model's 63 expert columns$"):
        sharding.check(CFG.replace(moe=dataclasses.replace(CFG.moe, expert_size=63)), 2)
    with pytest.raises(JaxspecError, match="exact weights"):
        SpecConfig(method="vegas", draft_weights="int8").validate().check_model(CFG)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "moe_intermediate_size"}))
    with pytest.raises(JaxspecError, match="moe_intermediate_size"):
        load_model(str(tmp_path), "float32")
