"""gpt-oss models: logits and greedy tokens against transformers' GptOssForCausalLM (eager attention,
float32, a tiny random checkpoint saved with save_pretrained: sinks, biased attention, sliding-window
layers of 8 keys between full ones, YaRN RoPE, 2 of 8 experts a token), prompts longer than the
window; the released MXFP4 expert form loading packed, to the same weights and logits as the
unquantized one (the dequantization against transformers' own); drafters lossless on a random gpt-oss model."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.convert import convert
from jaxspec.decoding import engine
from jaxspec.decoding.drafters import DraftRows, make_drafter
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.loaders import hf, load_model
from jaxspec.models.config import ModelConfig, MoEConfig, RopeConfig
from jaxspec.models import decoder
from jaxspec.models.decoder import score
from jaxspec.models.draft_weights import with_draft_weights
from jaxspec.models.kvcache import KVCache
import pallas_kernels as kernels
from pallas_kernels.mxfp4 import MXFP4, dequantize
from paged_pools import scatter
from test_moe_model import greedy, random_model

STOP = jnp.array([-1], jnp.int32)


def transformers_model(path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def test_config_and_logits_equal_transformers(hf_checkpoints):
    import torch

    path = hf_checkpoints["gpt_oss"]
    cfg, params, _ = load_model(str(path), "float32")
    assert (cfg.sinks, cfg.o_bias, cfg.qkv_bias, cfg.sliding_window, cfg.sliding_layers) == (True, True, True, 8, (0, 2))
    assert cfg.moe == MoEConfig(8, 2, 64, router="topk_softmax", norm_topk_prob=False, activation="gpt_oss", bias=True)
    assert cfg.rope.kind == "yarn" and not cfg.rope.truncate
    tokens = np.random.default_rng(2).integers(1, cfg.vocab_size, (2, 30))  # well past the window of 8
    with torch.no_grad():
        want = transformers_model(path)(torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(score(params, cfg, jnp.asarray(tokens)))
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()


def test_greedy_tokens_equal_transformers(hf_checkpoints):
    import torch

    path = hf_checkpoints["gpt_oss"]
    cfg, params, _ = load_model(str(path), "float32")
    prompt = np.random.default_rng(3).integers(1, cfg.vocab_size, (1, 21))
    with torch.no_grad():
        want = transformers_model(path).generate(torch.from_numpy(prompt), max_new_tokens=16, do_sample=False,
                                                 eos_token_id=None, pad_token_id=0)[0, 21:].tolist()
    out = jax.jit(engine.Engine(cfg, SpecConfig(), SamplingConfig(), 40).generate)(
        params, jnp.asarray(prompt, jnp.int32), jnp.asarray([21], jnp.int32), jax.random.key(0), max_new_tokens=16,
        stop_ids=STOP)
    assert np.asarray(out.tokens)[0, 21:37].tolist() == want


def test_mxfp4_experts_load_packed_as_their_dequantized_weights(hf_checkpoints, tmp_path):
    """The released form: each expert matrix as NAME_blocks + NAME_scales. Our dequantization equals
    transformers' on random codes and exponents; a checkpoint in that form loads packed (MXFP4 stacks,
    the non-expert params in float32), to the weights and the logits of the same checkpoint written
    unquantized, its codes re-packed as words (the kernels' form); converted to a jaxspec checkpoint (bf16,
    which stores the released bytes: orbax restores them as such) it loads packed again, unchanged."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(4)
    src = hf_checkpoints["gpt_oss"]
    cfg = hf.read_config(src, "float32")
    E, D, F = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_size
    tensors = load_file(src / "model.safetensors")
    for i in range(cfg.num_layers):
        for name, (rows, cols) in (("gate_up_proj", (2 * F, D)), ("down_proj", (D, F))):
            blocks = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(120, 130, (E, rows, cols // 32), dtype=np.uint8)
            want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            np.testing.assert_array_equal(np.asarray(dequantize(hf.mxfp4(blocks, scales))), want.numpy())
            key = f"model.layers.{i}.mlp.experts.{name}"
            tensors[key] = want.numpy()
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    for out, keep in ((plain, lambda k: not k.endswith(("_blocks", "_scales"))),
                      (packed, lambda k: not k.endswith(("gate_up_proj", "down_proj")))):
        shutil.copytree(src, out)
        save_file({k: v for k, v in tensors.items() if keep(k)}, str(out / "model.safetensors"))
    (_, a, _), (_, b, _) = load_model(str(plain), "float32"), load_model(str(packed), "float32")
    for name in ("moe_gate_up", "moe_down"):
        assert isinstance(b["layers"][name], MXFP4) and b["layers"][name].words
        assert not b["layers"][name].small_scales  # scales up to 129: two multiplies an output
        np.testing.assert_array_equal(np.asarray(a["layers"][name]), np.asarray(dequantize(b["layers"][name])))
    assert b["layers"]["wqkv"].dtype == jnp.float32
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 20)))
    want, got = (np.asarray(score(params, cfg, tokens)) for params in (a, b))
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    convert(str(packed), tmp_path / "ckpt", "bfloat16")  # a jaxspec checkpoint keeps them packed, unchanged
    _, c, _ = load_model(str(tmp_path / "ckpt"), "float32")
    for name in ("moe_gate_up", "moe_down"):
        assert isinstance(c["layers"][name], MXFP4)
        for leaf in ("blocks", "scales"):
            np.testing.assert_array_equal(np.asarray(getattr(c["layers"][name], leaf)),
                                          np.asarray(getattr(b["layers"][name], leaf)))
    assert c["layers"]["wqkv"].dtype == jnp.float32


CFG = ModelConfig(model_type="gpt_oss", vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=32, intermediate_size=64, qkv_bias=True, o_bias=True, sinks=True, sliding_window=16,
                  sliding_layers=(0, 2), dtype="float32",
                  rope=RopeConfig(theta=150000.0, kind="yarn", factor=32.0, original_max_position=4096, truncate=False),
                  moe=MoEConfig(8, 2, 64, router="topk_softmax", norm_topk_prob=False, activation="gpt_oss", bias=True))


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, 5, [200, 37, 90])


# vegas selects over every layer, and a sliding-window layer's draft sees its selection within the
# window; the tree verifies against the window and the sinks too. Stream, quest and ngram: slow.
@pytest.mark.parametrize("spec", [
    SpecConfig(method="vegas", gamma=4, ratio=0.1, min_tokens=16),
    SpecConfig(method="vegas", tree=(3, 2, 1), ratio=0.1, min_tokens=16),
    pytest.param(SpecConfig(method="stream", gamma=4, ratio=0.1, min_tokens=16), marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="quest", gamma=4, ratio=0.1, min_tokens=16), marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="ngram", gamma=4), marks=pytest.mark.slow),
], ids=["vegas", "vegas tree", "stream", "quest", "ngram"])
def test_drafters_equal_plain(model, spec):
    params, ids, lengths, plain = model
    assert greedy(CFG, params, spec, ids, lengths) == plain


def test_a_sliding_layer_drafts_over_its_whole_window():
    """A sparse drafter's draft attention on a sliding-window layer is verification's over the window,
    whatever its selection (here 16 slots, fewer than the window's 32); on a full layer it reads the
    selection and the tail."""
    cfg = CFG.replace(sliding_window=32)
    drafter = make_drafter(SpecConfig(method="vegas", gamma=2, ratio=0.01, min_tokens=16).validate(), cfg, 256)
    rng = np.random.default_rng(6)
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, 256, cfg.head_dim)
    (k, v), pages = scatter([jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)], 128, 6)
    cache = KVCache(k, v, pages, page_size=128)
    q = jnp.asarray(rng.standard_normal((2, 1, cfg.num_heads, cfg.head_dim)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal((cfg.num_layers, cfg.num_heads)), jnp.float32)
    first = jnp.asarray([100, 150], jnp.int32)
    idx = jnp.asarray(np.stack([rng.choice(int(f) - 5, 16, replace=False) for f in first])[:, None], jnp.int32)
    n_idx, tail_start = jnp.full((2,), 16, jnp.int32), first - 5
    rows = DraftRows(first, jnp.int32(0), jnp.arange(1, dtype=jnp.int32), jnp.ones((1, 1), bool), chain=True)
    attend, _ = drafter.sparse_attend(idx, n_idx, tail_start, rows, tail_capacity=8)
    scale = cfg.head_dim**-0.5
    for layer in (0, 1):  # sliding, full
        gates = decoder.layer_sink_window(cfg, sinks, first[:, None], jnp.int32(layer))
        out, _, _ = attend(jnp.int32(layer), q, cache, None, gates, ())
        if layer in cfg.sliding_layers:
            want = kernels.verify_attention(q, k, v, pages, layer, first[:, None], page_size=128, scale=scale,
                                            sinks=sinks, lo=gates.lo)[0]
        else:
            want = kernels.sparse_attention(q, k, v, pages, layer, idx, n_idx, tail_start, first[:, None],
                                            page_size=128, scale=scale, tail_capacity=8, sinks=sinks, lo=gates.lo)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=f"layer {layer}")


def test_a_draft_that_skips_a_silent_layer_is_always_accepted(model):
    """Layer 1 made silent (its o and down products and biases zero: it adds nothing to the stream),
    a draft that skips it is the model itself: every draft of `full` must be accepted. The draft reads
    each kept layer's sink logits at the model layer, as verification does (a sink row of another layer
    would make drafts differ)."""
    params, ids, lengths, _ = model
    layers = dict(params["layers"])
    for name in ("wo", "bo", "moe_down", "moe_down_bias"):
        layers[name] = layers[name].at[1].set(0)
    silent = {**params, "layers": layers}
    plain = greedy(CFG, silent, SpecConfig(), ids, lengths)
    spec = SpecConfig(method="full", gamma=4, draft_skip=(1,)).validate()
    spec.check_model(CFG)
    out = jax.jit(engine.Engine(CFG, spec, SamplingConfig(), max(lengths) + 24).generate)(
        with_draft_weights(silent, "exact", (1,)), jnp.asarray(ids), jnp.asarray(lengths, jnp.int32), jax.random.key(0),
        max_new_tokens=24, stop_ids=STOP)
    tokens, length, stats = jax.device_get((out.tokens, out.length, out.stats))
    assert [tokens[b, n:length[b]].tolist() for b, n in enumerate(lengths)] == plain
    assert stats.accepted.sum() == stats.drafted.sum() > 0, (stats.accepted.sum(), stats.drafted.sum())


def test_refused_in_one_line(hf_checkpoints, tmp_path):
    with pytest.raises(JaxspecError, match="sliding-window layers"):
        CFG.replace(sliding_layers=(0, 4))
    path = tmp_path / "broken"
    shutil.copytree(hf_checkpoints["gpt_oss"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(JaxspecError, match="gate_up"):
        load_model(str(path), "float32")
