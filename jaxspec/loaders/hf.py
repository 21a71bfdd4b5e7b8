"""Hugging Face checkpoints: config.json plus one or sharded safetensors files.

HF stores Linear weights as [out, in]; jaxspec multiplies x @ W, so projections are transposed here,
and per-layer tensors are stacked along a leading layer axis (see `jaxspec.model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import JaxspecError
from jaxspec.model import Params, param_shapes

# jaxspec layer key -> (HF name inside model.layers.{i}., transpose)
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
TOP_TENSORS = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def read_config(path: Path, dtype: str) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise JaxspecError(f"cannot read {path / 'config.json'}: {e}") from None
    return ModelConfig.from_hf(hf, dtype=dtype)


def build_params(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> Params:
    """Assembles the params pytree from `get(hf_name) -> array`, checking every shape.

    Shared by the safetensors and GGUF loaders (GGUF names are mapped to HF names first).
    """
    shapes = param_shapes(cfg)
    dtype = jnp.dtype(cfg.dtype)

    def tensor(name: str, transpose: bool, shape: tuple[int, ...]) -> jnp.ndarray:
        w = jnp.asarray(get(name))
        w = w.T if transpose else w
        if w.shape != shape:
            raise JaxspecError(f"tensor {name} has shape {tuple(w.shape)}, expected {shape}")
        return w.astype(dtype)

    params: Params = {
        key: tensor(*TOP_TENSORS[key], shapes[key]) for key in ("embed", "final_norm", "lm_head") if key in shapes
    }
    params["layers"] = {
        key: jnp.stack(
            [tensor(f"model.layers.{i}.{LAYER_TENSORS[key][0]}", LAYER_TENSORS[key][1], shape[1:]) for i in range(shape[0])]
        )
        for key, shape in shapes["layers"].items()
    }
    return params


def load(path: Path, dtype: str) -> tuple[ModelConfig, Params]:
    """Loads config.json and model.safetensors (or the shards named by model.safetensors.index.json)."""
    from safetensors import SafetensorError, safe_open

    cfg = read_config(path, dtype)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise JaxspecError(f"cannot read {index}: {e}") from None
    elif (path / "model.safetensors").exists():
        weight_map = None
    else:
        raise JaxspecError(f"{path} has no model.safetensors or model.safetensors.index.json")

    files: dict[str, object] = {}

    def get(name: str) -> np.ndarray:
        file = "model.safetensors" if weight_map is None else weight_map.get(name)
        if file is None:
            raise JaxspecError(f"checkpoint {path} has no tensor {name}")
        try:
            if file not in files:
                files[file] = safe_open(path / file, framework="flax")
            if name not in files[file].keys():
                raise JaxspecError(f"checkpoint {path} has no tensor {name}")
            return files[file].get_tensor(name)
        except SafetensorError as e:
            raise JaxspecError(f"corrupt or incomplete safetensors file {path / file}: {e}") from None
        except FileNotFoundError:
            raise JaxspecError(f"missing safetensors shard {path / file}") from None

    return cfg, build_params(cfg, get)
