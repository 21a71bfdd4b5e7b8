"""Hugging Face checkpoints: config.json plus one or sharded safetensors files.

HF stores Linear weights as [out, in]; jaxspec multiplies x @ W, so projections are transposed here,
q/k/v and gate/up are concatenated into one matrix each, and per-layer tensors are stacked along a
leading layer axis (see `jaxspec.models.decoder`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.errors import JaxspecError
from jaxspec.models.decoder import Params, param_shapes

# jaxspec layer key -> (HF names inside model.layers.{i}., concatenated along the last axis; transpose)
LAYER_TENSORS = {
    "attn_norm": (("input_layernorm.weight",), False),
    "wqkv": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), True),
    "wo": (("self_attn.o_proj.weight",), True),
    "bqkv": (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), False),
    "q_norm": (("self_attn.q_norm.weight",), False),
    "k_norm": (("self_attn.k_norm.weight",), False),
    "mlp_norm": (("post_attention_layernorm.weight",), False),
    "w_gate_up": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), True),
    "w_down": (("mlp.down_proj.weight",), True),
}
# NSA models (llama-nsa) append the gate projection to the fused q/k/v matrix (and bias)
NSA_GATE = {"wqkv": "self_attn.g_proj.weight", "bqkv": "self_attn.g_proj.bias"}
TOP_TENSORS = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def layer_tensor_names(cfg: ModelConfig, key: str) -> tuple[str, ...]:
    """The HF names (inside model.layers.{i}.) that make up the jaxspec layer tensor `key`, in order."""
    return LAYER_TENSORS[key][0] + ((NSA_GATE[key],) if cfg.nsa and key in NSA_GATE else ())


def read_config(path: Path, dtype: str) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise JaxspecError(f"cannot read {path / 'config.json'}: {e}") from None
    return ModelConfig.from_hf(hf, dtype=dtype)


def build_params(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> Params:
    """Assembles the params pytree from `get(hf_name) -> array`, checking every shape, as host
    (numpy) arrays: `load_model` places them (on one device, or split over a mesh).

    Shared by the safetensors and GGUF loaders (GGUF names are mapped to HF names first).
    """
    shapes = param_shapes(cfg)
    dtype = jnp.dtype(cfg.dtype)

    def tensor(names: tuple[str, ...], transpose: bool, shape: tuple[int, ...]) -> np.ndarray:
        """The named tensors (HF layout), transposed if asked and concatenated along the last axis."""
        parts = [np.asarray(get(name)) for name in names]
        parts = [w.T if transpose else w for w in parts]
        if any(w.shape[:-1] != shape[:-1] for w in parts) or sum(w.shape[-1] for w in parts) != shape[-1]:
            file_shape = lambda s: tuple(s[::-1]) if transpose else tuple(s)
            got = " + ".join(f"{n} has shape {file_shape(w.shape)}" for n, w in zip(names, parts))
            raise JaxspecError(f"tensor {got}, expected {file_shape(shape)}{' together' if len(names) > 1 else ''}")
        return np.concatenate(parts, axis=-1).astype(dtype) if len(parts) > 1 else parts[0].astype(dtype)

    params: Params = {
        key: tensor((TOP_TENSORS[key][0],), TOP_TENSORS[key][1], shapes[key])
        for key in ("embed", "final_norm", "lm_head")
        if key in shapes
    }
    params["layers"] = {
        key: np.stack(
            [tensor(tuple(f"model.layers.{i}.{n}" for n in layer_tensor_names(cfg, key)), LAYER_TENSORS[key][1], shape[1:])
             for i in range(shape[0])]
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
                files[file] = safe_open(path / file, framework="numpy")
            if name not in files[file].keys():
                raise JaxspecError(f"checkpoint {path} has no tensor {name}")
            return files[file].get_tensor(name)
        except SafetensorError as e:
            raise JaxspecError(f"corrupt or incomplete safetensors file {path / file}: {e}") from None
        except FileNotFoundError:
            raise JaxspecError(f"missing safetensors shard {path / file}") from None

    return cfg, build_params(cfg, get)
