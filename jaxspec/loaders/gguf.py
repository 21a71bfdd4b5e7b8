"""GGUF files (llama.cpp): config from metadata, tensors dequantized to float32 with the `gguf` package.

GGUF names are mapped to HF names so `hf.build_params` assembles and shape-checks the pytree. Two
layout differences to undo: GGUF lists dimensions innermost first (so a [out, in] HF matrix is stored
with shape [in, out]), and llama.cpp permutes the rows of Llama's q/k projections for its interleaved
RoPE (Qwen2/Qwen3 GGUFs use NeoX RoPE and are stored unpermuted).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from jaxspec.models.config import ModelConfig, RopeConfig
from jaxspec.errors import JaxspecError
from jaxspec.loaders.hf import build_params
from jaxspec.models.decoder import Params
from jaxspec.tokenizer import Tokenizer

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF general.architecture names = jaxspec model types

TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def load(path: Path, dtype: str) -> tuple[ModelConfig, Params, Tokenizer]:
    """Config and tokenizer first (cheap, and they reject unsupported files), then the tensors."""
    reader = _open(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = read_config(meta, set(tensors), dtype)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    unpermute_heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if cfg.model_type == "llama" else {}

    def get(hf_name: str) -> np.ndarray:
        name = gguf_name(hf_name)
        if name not in tensors:
            raise JaxspecError(f"GGUF file {path} has no tensor {name}")
        w = dequantize(tensors[name], path)
        heads = unpermute_heads.get(name.split(".")[-2])
        return w if heads is None else unpermute_rope(w, heads)

    return cfg, build_params(cfg, get), tokenizer


def read_file_config(path: Path, dtype: str) -> ModelConfig:
    """The config alone, from the file's header (no tensor is read)."""
    reader = _open(path)
    return read_config(read_metadata(reader), {t.name for t in reader.tensors}, dtype)


def _open(path: Path) -> GGUFReader:
    """The file's reader; the last one is kept (its header parse is seconds for a 49K-token vocabulary:
    the CLI reads the config before the tensors), and read again if the file changed."""
    try:
        stat = path.stat()
        return _reader(path.resolve(), stat.st_mtime_ns, stat.st_size)
    except OSError as e:
        raise JaxspecError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # the reader fails on bad bytes with ValueError, IndexError, struct/numpy errors
        raise JaxspecError(f"corrupt or truncated GGUF file {path}: {e}") from None


@functools.lru_cache(maxsize=1)
def _reader(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    del mtime_ns, size  # the cache key: a rewritten file is parsed again
    return _PlainViews(path)


class _PlainViews(GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map: the parse takes a view per field
    part and dequantization splits tensors into many views, and a view of an `np.memmap` runs a
    Python hook each time, over a million of them for SmolLM2 (bench/NOTES.md, "the next segment
    dispatched before the host reads", its GGUF header parse). Same bytes, still mapped, not copied."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._data = np.asarray(mapped)


def read_metadata(reader: GGUFReader) -> dict:
    """All key-value fields as Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def read_config(meta: dict, tensor_names: set[str], dtype: str) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; eos/bos ids are left to the tokenizer (see `load_model`)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise JaxspecError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")

    def field(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise JaxspecError(f"GGUF metadata is missing {arch}.{key}")
        return value

    if "rope_freqs.weight" in tensor_names:
        raise JaxspecError("GGUF rope frequency factors (rope_freqs.weight, Llama 3.1+ RoPE) are not supported")
    hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    if int(field("rope.dimension_count", head_dim)) != head_dim:
        raise JaxspecError("partial rotary embeddings (rope.dimension_count != head dim) are not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(field("block_count")),
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(field("feed_forward_length")),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope(meta, arch),
        max_position_embeddings=int(field("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3",
        dtype=dtype,
    )


def _rope(meta: dict, arch: str) -> RopeConfig:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeConfig(theta=theta)
    if kind not in ("linear", "yarn"):
        raise JaxspecError(f"unsupported GGUF rope scaling type {kind!r}")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 0))
    return RopeConfig(theta=theta, kind=kind, factor=factor, original_max_position=original)


def gguf_name(hf_name: str) -> str:
    """HF tensor name -> GGUF tensor name (`model.layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`)."""
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    layer, module, kind = _LAYER_RE.fullmatch(hf_name).groups()
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def dequantize(tensor, path: Path) -> np.ndarray:
    """float32 array in HF layout (dimensions outermost first) of any type `gguf` can dequantize."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        return np.asarray(gguf_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise JaxspecError(f"unsupported GGUF tensor type {tensor.tensor_type.name} ({tensor.name})") from None
    except ValueError as e:
        raise JaxspecError(f"corrupt or truncated GGUF tensor {tensor.name} in {path}: {e}") from None


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
