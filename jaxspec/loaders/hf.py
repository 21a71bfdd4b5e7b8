"""Hugging Face checkpoints: config.json plus one or sharded safetensors files, read (`load`) and
written (`write_hf`, Llama-family models with their tokenizer: what `jaxspec.convert --to-nsa` writes).

HF stores Linear weights as [out, in]; jaxspec multiplies x @ W, so projections are transposed here,
q/k/v and gate/up are concatenated into one matrix each, and per-layer tensors are stacked along a
leading layer axis (see `jaxspec.models.decoder`); the writer undoes each step with the same name map.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import files
from jaxspec.errors import JaxspecError
from jaxspec.models.config import ModelConfig, nsa_hf_keys
from jaxspec.models.decoder import Params, gate_dim, param_shapes
from pallas_kernels.mxfp4 import MXFP4

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
    "router": (("mlp.gate.weight",), False),
    "router_bias": (("mlp.router.bias",), False),
    "bo": (("self_attn.o_proj.bias",), False),
    "sinks": (("self_attn.sinks",), False),
}
ROUTER_NAMES = {"gpt_oss": "mlp.router.weight"}  # the router's weight where not Qwen3-MoE's mlp.gate.weight
# MoE models: the experts' tensors inside model.layers.{i}.mlp.experts.{e}., stacked over the experts
# (the layout of the released Qwen3-MoE checkpoints, and what transformers' save_pretrained writes)
EXPERT_TENSORS = {
    "moe_gate_up": (("gate_proj.weight", "up_proj.weight"), True),
    "moe_down": (("down_proj.weight",), True),
}
# gpt-oss: each layer's experts in one tensor inside model.layers.{i}.mlp.experts. (x @ W layout), the
# gate and up columns interleaved (gate even, up odd), or the released MXFP4 form of the matrices
# (NAME_blocks [E, out, in / 32, 16] of packed 4-bit values, NAME_scales [E, out, in / 32] exponents),
# kept packed: the MoE kernel decodes it in registers (pallas_kernels.mxfp4.MXFP4)
GPT_OSS_EXPERTS = {"moe_gate_up": "gate_up_proj", "moe_down": "down_proj", "moe_gate_up_bias": "gate_up_proj_bias",
                   "moe_down_bias": "down_proj_bias"}


def mxfp4(blocks: np.ndarray, scales: np.ndarray) -> MXFP4:
    """The MXFP4 stack of matrices [E, in, out] in gpt-oss's released form: blocks [E, out, G, 16]
    uint8 (two codes a byte, the low nibble first), scales [E, out, G] uint8 (in = 32 G)."""
    return MXFP4(blocks.reshape(*blocks.shape[:-2], -1), scales)


def gate_then_up(a: np.ndarray, axis: int) -> np.ndarray:
    """gpt-oss's interleaved gate/up outputs along `axis` (gate even, up odd) -> gate, then up."""
    n = a.shape[axis]
    return np.take(a, np.r_[0:n:2, 1:n:2], axis=axis)


def gpt_oss_experts(key: str, layer: int, get: Callable[[str], np.ndarray],
                    has: Callable[[str], bool]) -> np.ndarray | MXFP4:
    """Layer `layer`'s expert tensor `key` of a gpt-oss checkpoint in jaxspec's layout (gate columns
    then up columns); an MXFP4 matrix stays packed, its gate/up output rows permuted whole."""
    name = f"model.layers.{layer}.mlp.experts.{GPT_OSS_EXPERTS[key]}"
    if key in ("moe_gate_up", "moe_down") and not has(name):
        w = mxfp4(np.asarray(get(name + "_blocks")), np.asarray(get(name + "_scales")))
        return jax.tree.map(lambda a: gate_then_up(a, 1), w) if key == "moe_gate_up" else w
    w = np.asarray(get(name))
    return gate_then_up(w, -1) if key.startswith("moe_gate_up") else w


# NSA models (llama-nsa) append the gate projection to the fused q/k/v matrix (and bias)
NSA_GATE = {"wqkv": "self_attn.g_proj.weight", "bqkv": "self_attn.g_proj.bias"}
TOP_TENSORS = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def layer_tensor_names(cfg: ModelConfig, key: str) -> tuple[str, ...]:
    """The HF names (inside model.layers.{i}.) that make up the jaxspec layer tensor `key`, in order."""
    if key == "router" and cfg.model_type in ROUTER_NAMES:
        return (ROUTER_NAMES[cfg.model_type],)
    return LAYER_TENSORS[key][0] + ((NSA_GATE[key],) if cfg.nsa and key in NSA_GATE else ())


def read_config(path: Path, dtype: str) -> ModelConfig:
    hf = files.read_json_object(path / "config.json", "model config")
    try:
        return ModelConfig.from_hf(hf, dtype=dtype)
    except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError) as e:  # a value of the wrong kind
        raise JaxspecError(f"{path / 'config.json'} has a bad value: {type(e).__name__}: {e}") from None


def build_params(cfg: ModelConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool] = lambda _: True) -> Params:
    """Assembles the params pytree from `get(hf_name) -> array`, checking every shape, as host
    (numpy) arrays: `load_model` places them (on one device, or split over a mesh). Each layer stack
    is filled in place, so a model's host copy peaks near its own size.

    Shared by the safetensors and GGUF loaders (GGUF names are mapped to HF names first); `has(name)`
    says whether a tensor exists (gpt-oss's experts come in two forms).
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
    def gpt_oss_stack(key: str, shape: tuple[int, ...]) -> np.ndarray | MXFP4:
        """A gpt-oss expert stack layer by layer: in `dtype`, or MXFP4 stacks of the checkpoint's bytes."""
        out = None
        for i in range(shape[0]):
            w = gpt_oss_experts(key, i, get, has)
            if w.shape != shape[1:]:
                raise JaxspecError(f"gpt-oss expert tensor {key} of layer {i} has shape {w.shape}, expected {shape[1:]}")
            if out is None:
                packed = isinstance(w, MXFP4)
                out = jax.tree.map(lambda a: np.empty((shape[0], *a.shape), a.dtype if packed else dtype), w)
            for o, a in zip(jax.tree.leaves(out), jax.tree.leaves(w), strict=True):
                o[i] = a
        return out

    def stack(key: str, shape: tuple[int, ...]) -> np.ndarray | MXFP4:
        if cfg.model_type == "gpt_oss" and key in GPT_OSS_EXPERTS:
            return gpt_oss_stack(key, shape)
        out = np.empty(shape, dtype)
        for i in range(shape[0]):
            if key in EXPERT_TENSORS:
                names, transpose = EXPERT_TENSORS[key]
                for e in range(shape[1]):
                    out[i, e] = tensor(tuple(f"model.layers.{i}.mlp.experts.{e}.{n}" for n in names), transpose, shape[2:])
            else:
                names = tuple(f"model.layers.{i}.{n}" for n in layer_tensor_names(cfg, key))
                out[i] = tensor(names, LAYER_TENSORS[key][1], shape[1:])
        return out

    params["layers"] = {key: stack(key, shape) for key, shape in shapes["layers"].items()}
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

    opened: dict[str, object] = {}

    def file_name(name: str) -> str | None:
        """The safetensors file that should hold `name` (None when the index names none)."""
        return "model.safetensors" if weight_map is None else weight_map.get(name)

    def file_of(name: str):
        """The open safetensors file that should hold `name`, or None when the index names none."""
        file = file_name(name)
        if file is None:
            return None
        try:
            if file not in opened:
                opened[file] = safe_open(path / file, framework="numpy")
        except SafetensorError as e:
            raise JaxspecError(f"corrupt or incomplete safetensors file {path / file}: {e}") from None
        except FileNotFoundError:
            raise JaxspecError(f"missing safetensors shard {path / file}") from None
        return opened[file]

    def has(name: str) -> bool:
        f = file_of(name)
        return f is not None and name in f.keys()

    def get(name: str) -> np.ndarray:
        if not has(name):
            raise JaxspecError(f"checkpoint {path} has no tensor {name}")
        try:
            return file_of(name).get_tensor(name)
        except SafetensorError as e:
            raise JaxspecError(f"corrupt or incomplete safetensors file {path / file_name(name)}: {e}") from None

    return cfg, build_params(cfg, get, has)


def hf_config(cfg: ModelConfig) -> dict:
    """config.json of `cfg` in the HF Llama layout (plus NSA-1B's keys for llama-nsa models)."""
    if cfg.model_type not in ("llama", "llama-nsa") or cfg.qk_norm:
        raise JaxspecError(f"cannot write a {cfg.model_type!r} model as an HF Llama directory")
    rope = cfg.rope
    hf = {
        "architectures": ["LlamaNSAForCausalLM" if cfg.nsa else "LlamaForCausalLM"],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope.theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "torch_dtype": cfg.dtype,
        "use_cache": True,
    }
    if rope.kind == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": rope.factor}
        if rope.original_max_position:
            hf["rope_scaling"]["original_max_position_embeddings"] = rope.original_max_position
    elif rope.kind == "llama3":
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                              "high_freq_factor": rope.high_freq_factor,
                              "original_max_position_embeddings": rope.original_max_position}
    elif rope.kind == "yarn":
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": rope.factor, "beta_fast": rope.beta_fast,
                              "beta_slow": rope.beta_slow, "attention_factor": rope.attention_factor,
                              "original_max_position_embeddings": rope.original_max_position, "truncate": rope.truncate}
    if cfg.nsa:
        hf.update(nsa_hf_keys(cfg.nsa))
        if cfg.nsa.refresh_layers:
            hf["nsa_refresh_layers"] = list(cfg.nsa.refresh_layers)
    return hf


def hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, jax.Array]:
    """The params under their HF names and layouts ([out, in] projections, one tensor per layer)."""
    shapes = param_shapes(cfg)
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    split_sizes = {
        "wqkv": [q_dim, kv_dim, kv_dim] + ([gate_dim(cfg)] if cfg.nsa else []),
        "bqkv": [q_dim, kv_dim, kv_dim] + ([gate_dim(cfg)] if cfg.nsa else []),
        "w_gate_up": [cfg.intermediate_size, cfg.intermediate_size],
    }
    out = {}
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes:
            name, transpose = TOP_TENSORS[key]
            out[name] = params[key].T if transpose else params[key]
    for key in shapes["layers"]:
        names, transpose = layer_tensor_names(cfg, key), LAYER_TENSORS[key][1]
        stacked = params["layers"][key]
        bounds = np.cumsum(split_sizes.get(key, [stacked.shape[-1]]))[:-1]
        for i in range(cfg.num_layers):
            for name, part in zip(names, jnp.split(stacked[i], bounds, axis=-1)):
                out[f"model.layers.{i}.{name}"] = part.T if transpose else part
    return {name: jnp.asarray(x) for name, x in out.items()}


def write_hf(path: Path, cfg: ModelConfig, params: Params, tokenizer) -> None:
    """Writes an HF directory into the existing directory `path`: config.json, generation_config.json,
    model.safetensors (HF names, at the params' dtype), tokenizer.json and tokenizer_config.json
    (what `load_model` and transformers read)."""
    from safetensors.flax import save_file

    config = hf_config(cfg.replace(bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(hf_tensors(cfg, params), str(path / "model.safetensors"), metadata={"format": "pt"})
    files.usual_mode(path / "model.safetensors")
    tokenizer.backend.save(str(path / "tokenizer.json"))
    token = lambda i: None if i is None else tokenizer.backend.id_to_token(i)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template:
        tok_config["chat_template"] = tokenizer.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
