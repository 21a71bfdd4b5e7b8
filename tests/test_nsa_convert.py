"""Dense Llama -> NSA (`jaxspec.models.nsa_convert`, the gate fit `jaxspec.training.nsa_gates`,
`python -m jaxspec.convert SRC DST --to-nsa`): every dense weight survives, the written HF directory
(NSA-1B format, `jaxspec.loaders.hf.write_hf`) loads back with equal logits, the cache-free forward of
the fit equals `decoder.score`, a few fit steps lower KL(dense || NSA), and the CLI fails in one line
without leaving anything half-written.

Everything runs on a tiny random Llama with a byte-level BPE tokenizer trained here, written as an HF
directory by jaxspec's own writer (no transformers), so the file stays fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import corpus
from jaxspec.convert import convert_to_nsa
from jaxspec.errors import JaxspecError
from jaxspec.loaders import hf, load_model
from jaxspec.models import decoder
from jaxspec.models import nsa_convert as nc
from jaxspec.models.config import ModelConfig, NSAConfig, nsa_hf_keys
from jaxspec.tokenizer import Tokenizer
from jaxspec.training import data, nsa_gates

REPO = Path(__file__).resolve().parents[1]
TINY_NSA = NSAConfig(block_size=4, block_counts=3, window_size=8, topk_rule="exact")
FIT = dict(fit_tokens=48, fit_batch=2, lr=1e-2)  # shared by the fit tests, so they share one compilation
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1\n"] * 20, trainer)
    return Tokenizer(backend, TEMPLATE, bos_token_id=1, eos_token_ids=(0, 2))


def tiny_config(tokenizer: Tokenizer, tied: bool = True, bias: bool = False) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=tokenizer.vocab_size + 4, hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-5, max_position_embeddings=256,
        tie_word_embeddings=tied, qkv_bias=bias, bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids, dtype="float32",
    )


@pytest.fixture(scope="module")
def dense(tokenizer, tmp_path_factory):
    """(cfg, params, HF dir) of a tiny dense Llama with tied embeddings."""
    cfg = tiny_config(tokenizer)
    params = random_params(cfg, 0)
    path = tmp_path_factory.mktemp("dense")
    hf.write_hf(path, cfg, params, tokenizer)
    return cfg, params, path


def random_params(cfg: ModelConfig, seed: int):
    """Random weights at the config's shapes (numpy: no per-shape compilations)."""
    rng = np.random.default_rng(seed)
    shapes = decoder.param_shapes(cfg)

    def make(path, shape):
        norm = "norm" in jax.tree_util.keystr(path)
        return jnp.asarray((1 + 0.1 * rng.normal(size=shape)) if norm else 0.3 * rng.normal(size=shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(make, shapes, is_leaf=lambda x: isinstance(x, tuple))


score = jax.jit(decoder.score, static_argnums=1)


def random_gates(cfg, seed=0):
    return np.random.default_rng(seed).normal(size=nc.gate_shape(cfg)).astype(np.float32)


def assert_params_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# --- to_nsa and the HF directory -------------------------------------------------------------------


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_to_nsa_keeps_weights_and_round_trips(tokenizer, tmp_path, tied, bias):
    cfg = tiny_config(tokenizer, tied, bias)
    params = random_params(cfg, 1)
    g = random_gates(cfg)
    nsa_cfg, nsa_params = nc.to_nsa(cfg, params, nc.DEFAULT_NSA, g)
    assert nsa_cfg == cfg.replace(model_type="llama-nsa", nsa=nc.DEFAULT_NSA)
    # every dense weight is kept: wqkv (and bqkv) gain gate columns at the end, nothing else changes
    qkv = params["layers"]["wqkv"].shape[-1]
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(path)
        y = nsa_params
        for k in path:
            y = y[k.key]
        np.testing.assert_array_equal(np.asarray(y[..., : x.shape[-1]]), np.asarray(x), err_msg=key)
        assert y.shape[-1] == x.shape[-1] + (3 * cfg.num_heads if "qkv" in key else 0)
    assert nsa_params["layers"]["wqkv"].shape[-1] == qkv + 3 * cfg.num_heads
    np.testing.assert_array_equal(nc.gates_of(nsa_cfg, nsa_params), g)
    if bias:
        np.testing.assert_array_equal(np.asarray(nsa_params["layers"]["bqkv"][..., qkv:]), 0)

    hf.write_hf(tmp_path, nsa_cfg, nsa_params, tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama-nsa" and config["architectures"] == ["LlamaNSAForCausalLM"]
    assert (config["block_size"], config["block_counts"], config["window_size"], config["nsa_topk_rule"]) == (16, 16, 128, "exact")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert f.get_tensor("model.layers.1.self_attn.g_proj.weight").shape == (3 * cfg.num_heads, cfg.hidden_size)
        assert ("lm_head.weight" in f.keys()) == (not tied)
    loaded_cfg, loaded_params, loaded_tok = load_model(str(tmp_path), "float32")
    assert loaded_cfg == nsa_cfg
    assert_params_equal(loaded_params, nsa_params)
    assert (loaded_tok.bos_token_id, loaded_tok.eos_token_ids, loaded_tok.chat_template) == (
        tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.chat_template)
    if tied:  # equal params and config give equal logits; check once, on the SmolLM2-like variant
        tokens = jnp.asarray([tokenizer.encode("The quick brown fox jumps over the lazy dog, " * 6)])
        np.testing.assert_array_equal(np.asarray(score(loaded_params, loaded_cfg, tokens)),
                                      np.asarray(score(nsa_params, nsa_cfg, tokens)))


def test_dense_writer_round_trips(dense, tokenizer):
    cfg, params, path = dense
    loaded_cfg, loaded_params, _ = load_model(str(path), "float32")
    assert loaded_cfg == cfg
    assert_params_equal(loaded_params, params)


def test_hf_config_rope_round_trip(tokenizer):
    from jaxspec.models.config import RopeConfig

    for rope in (RopeConfig(theta=5e5, kind="llama3", factor=8.0, original_max_position=64),
                 RopeConfig(theta=1e4, kind="linear", factor=2.0, original_max_position=256)):
        cfg = tiny_config(tokenizer).replace(rope=rope)
        assert ModelConfig.from_hf(hf.hf_config(cfg), dtype="float32") == cfg


def test_to_nsa_rejects(tokenizer):
    cfg = tiny_config(tokenizer)
    with pytest.raises(JaxspecError, match="g_proj has shape"):
        nc.to_nsa(cfg, {}, TINY_NSA, np.zeros((2, 3, 4)))
    with pytest.raises(JaxspecError, match="needs a dense Llama-family model"):
        nc.to_nsa(cfg.replace(model_type="qwen3", qk_norm=True), {}, TINY_NSA, np.zeros(nc.gate_shape(cfg)))


# --- the fit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["exact", "nsa1b"])
def test_nsa_logits_equals_score(dense, rule):
    """The fit's cache-free forward is the decoder's NSA forward (T not a multiple of the block size,
    more blocks than the nsa1b rule's chunk, so its chunked selection differs from exact)."""
    cfg, params, _ = dense
    nsa_cfg, nsa_params = nc.to_nsa(cfg, params, NSAConfig(block_size=4, block_counts=3, window_size=8, topk_rule=rule),
                                    random_gates(cfg))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 110)), jnp.int32)
    expected = score(nsa_params, nsa_cfg, tokens)
    np.testing.assert_allclose(np.asarray(nsa_gates.nsa_logits(nsa_params, nsa_cfg, tokens)), np.asarray(expected), atol=1e-4)


def test_fit_gates_lowers_kl(dense):
    cfg, params, _ = dense
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (FIT["fit_batch"], FIT["fit_tokens"]))
    zeros = np.zeros(nc.gate_shape(cfg), np.float32)
    before = nsa_gates.kl_divergence(cfg, params, zeros, tokens, TINY_NSA)
    history, lines = [], []
    g = nsa_gates.fit_gates(cfg, params, iter([tokens] * 3), 3, FIT["lr"], nsa_cfg=TINY_NSA, log_every=2, log=lines.append,
                     history=history)
    after = nsa_gates.kl_divergence(cfg, params, g, tokens, TINY_NSA)
    assert g.shape == nc.gate_shape(cfg) and g.dtype == np.float32 and np.abs(g).max() > 0
    assert len(history) == 3 and history[0] == pytest.approx(before, rel=1e-4)
    assert after < before and history[-1] < history[0]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"] and "s/step" in lines[-1]


def test_splits_are_disjoint(tokenizer):
    train, held = data.split_documents()
    assert held and train and not set(train) & set(held)
    assert len(train) + len(held) == len(corpus.documents())
    windows = data.heldout_windows(tokenizer, 64, count=3)
    assert windows.shape == (3, 64)
    batch = next(data.training_batches(tokenizer, 64, 2, seed=1))
    assert batch.shape == (2, 64) and batch.dtype == np.int32


# --- convert_to_nsa and the CLI ----------------------------------------------------------------------


def test_convert_with_fit_and_gate_files(dense, tmp_path):
    """A fit through the converter: DST loads back as the NSA model of the fitted gates, which are in
    DST and in --gates-out; converting again from that gate file gives the same model."""
    cfg, params, src = dense
    lines = []
    summary = convert_to_nsa(str(src), tmp_path / "nsa", nsa_cfg=TINY_NSA, fit_steps=2, gates_out=tmp_path / "g.safetensors",
                             log=lines.append, **FIT)
    assert summary.startswith(f"wrote {tmp_path / 'nsa'} (llama-nsa, ") and "fitted in 2 steps" in summary
    assert lines[0].startswith("fitting NSA gates [2, 12, 32]") and any("held-out KL" in line for line in lines)
    g, info = nsa_gates.load_gates(tmp_path / "g.safetensors", cfg, TINY_NSA)
    assert info["fit"]["steps"] == 2 and info["nsa"] == nsa_hf_keys(TINY_NSA)
    np.testing.assert_array_equal(nsa_gates.load_gates(tmp_path / "nsa" / nsa_gates.GATES_FILE)[0], g)
    loaded_cfg, loaded_params, _ = load_model(str(tmp_path / "nsa"), "float32")
    expected_cfg, expected_params = nc.to_nsa(cfg, params, TINY_NSA, g)
    assert loaded_cfg == expected_cfg
    assert_params_equal(loaded_params, expected_params)

    convert_to_nsa(str(src), tmp_path / "again", "bfloat16", nsa_cfg=TINY_NSA, gates=tmp_path / "g.safetensors")
    again_cfg, again_params, _ = load_model(str(tmp_path / "again"), "bfloat16")
    assert again_cfg == expected_cfg.replace(dtype="bfloat16")
    assert_params_equal(again_params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), expected_params))
    with pytest.raises(JaxspecError, match="was fitted for NSA"):
        convert_to_nsa(str(src), tmp_path / "other", gates=tmp_path / "g.safetensors")  # default NSA settings
    assert leftovers(tmp_path) == []


def test_convert_calibrates_the_reuse_schedule(dense, tmp_path):
    """--calibrate-reuse: the schedule lands in config.json (loaded back into NSAConfig) with its report;
    an unbounded KL leaves layer 0 as the only refresh layer."""
    cfg, params, src = dense
    gates = tmp_path / "g.safetensors"
    nsa_gates.save_gates(gates, random_gates(cfg), {"nsa": nsa_hf_keys(TINY_NSA)})
    lines = []
    convert_to_nsa(str(src), tmp_path / "nsa", nsa_cfg=TINY_NSA, gates=gates, calibrate_reuse=float("inf"),
                   calibrate_tokens=64, log=lines.append)
    cfg, _, _ = load_model(str(tmp_path / "nsa"), "float32")
    assert cfg.nsa.refresh_layers == (0,)
    report = json.loads((tmp_path / "nsa" / "nsa_reuse_calibration.json").read_text())
    assert report["refresh_layers"] == [0] and len(report["trials"]) == cfg.num_layers - 1
    assert any(line.startswith("refresh layers [0]") for line in lines)
    with pytest.raises(JaxspecError, match="--calibrate-reuse"):
        convert_to_nsa(str(src), tmp_path / "bad", nsa_cfg=TINY_NSA, gates=gates, calibrate_reuse=-1.0)
    assert leftovers(tmp_path) == []


def test_gates_of_other_weights_warn(dense, tokenizer, tmp_path, capsys):
    cfg, params, src = dense
    gates = tmp_path / "g.safetensors"
    nsa_gates.save_gates(gates, random_gates(cfg), {"nsa": nsa_hf_keys(TINY_NSA), "source": "mine",
                                             "source_fingerprint": nsa_gates.model_fingerprint(params)})
    convert_to_nsa(str(src), tmp_path / "same", nsa_cfg=TINY_NSA, gates=gates)
    assert capsys.readouterr().err == ""
    other = tmp_path / "other_dense"
    other.mkdir()
    hf.write_hf(other, cfg, random_params(cfg, 7), tokenizer)
    convert_to_nsa(str(other), tmp_path / "other", nsa_cfg=TINY_NSA, gates=gates)
    assert "were fitted to other weights (mine)" in capsys.readouterr().err


def test_convert_gate_file_errors(dense, tmp_path, monkeypatch):
    cfg, _, src = dense
    monkeypatch.setattr(nsa_gates, "SHIPPED_GATES", tmp_path / "missing.safetensors")
    with pytest.raises(JaxspecError, match="shipped gate file .* is missing"):
        convert_to_nsa(str(src), tmp_path / "a")
    wrong = tmp_path / "wrong.safetensors"
    nsa_gates.save_gates(wrong, np.zeros((30, 27, 576), np.float32), {"nsa": nsa_hf_keys(nc.DEFAULT_NSA)})
    monkeypatch.setattr(nsa_gates, "SHIPPED_GATES", wrong)
    with pytest.raises(JaxspecError, match=r"holds g_proj \[30, 27, 576\], this model needs \[2, 12, 32\]"):
        convert_to_nsa(str(src), tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrong.safetensors"]


def fail_while_writing(monkeypatch):
    def write_hf(path, *args):
        (path / "config.json").write_text("{half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "write_hf", write_hf)


def test_failure_leaves_nothing(dense, tmp_path, monkeypatch):
    cfg, _, src = dense
    gates = tmp_path / "gates.safetensors"
    nsa_gates.save_gates(gates, random_gates(cfg), {"nsa": nsa_hf_keys(TINY_NSA)})
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("keep")
    fail_while_writing(monkeypatch)
    with pytest.raises(JaxspecError, match="No space left on device"):
        convert_to_nsa(str(src), tmp_path / "new", nsa_cfg=TINY_NSA, gates=gates)
    with pytest.raises(JaxspecError, match="No space left on device"):
        convert_to_nsa(str(src), old, force=True, nsa_cfg=TINY_NSA, gates=gates)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gates.safetensors", "old"]
    assert [p.name for p in old.iterdir()] == ["keep.txt"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jaxspec.convert", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("case", ["not_llama", "exists", "no_to_nsa"])
def test_cli_errors(dense, tmp_path, case):
    _, params, src = dense
    if case == "not_llama":  # a Qwen2 directory: the same tensors plus qkv biases, model_type qwen2
        qwen = tmp_path / "qwen"
        qwen.mkdir()
        cfg = tiny_config(Tokenizer.from_hf_dir(src), bias=True)
        hf.write_hf(qwen, cfg, random_params(cfg, 2), Tokenizer.from_hf_dir(src))
        config = json.loads((qwen / "config.json").read_text())
        (qwen / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
        args = [str(qwen), str(tmp_path / "out"), "--to-nsa", "--fit-steps", "1"]  # no gate file needed
        message = "needs a dense Llama-family model (model_type 'llama'), got 'qwen2'"
    elif case == "exists":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "keep.txt").write_text("keep")
        args, message = [str(src), str(tmp_path / "out"), "--to-nsa", "--fit-steps", "2"], "already exists"
    else:
        args, message = [str(src), str(tmp_path / "out"), "--fit-steps", "2"], "--fit-steps needs --to-nsa"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
