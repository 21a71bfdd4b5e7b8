"""A dense Llama model -> an NSA model (NSA-1B's `llama-nsa` format): the conversion of weights.

Every dense weight is kept; NSA adds only the gate projection `g_proj` [3 Hq, D] per layer, appended
to the fused q/k/v matrix (the gates are fitted by `jaxspec.training.nsa_gates`; the HF directory is
written by `jaxspec.loaders.hf.write_hf`).

    to_nsa(cfg, params, nsa_cfg, g_proj) -> (cfg, params)   append the gate columns to wqkv
    gates_of(cfg, params) -> g_proj                          the inverse

`g_proj` is always in the HF layout, float32 [L, 3 Hq, D] (the stacked `self_attn.g_proj.weight`s;
rows (compressed, selected, window) per query head); the decoder's params hold its transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.models import decoder
from jaxspec.models.config import ModelConfig, NSAConfig

Params = decoder.Params

# The NSA settings of the SmolLM2-derived model, which its shipped gates were fitted for (checkpoints/README.md).
DEFAULT_NSA = NSAConfig(block_size=16, block_counts=16, window_size=128, topk_rule="exact")


def check_dense_llama(cfg: ModelConfig) -> None:
    if cfg.model_type != "llama":
        raise JaxspecError(
            f"--to-nsa needs a dense Llama-family model (model_type 'llama'), got {cfg.model_type!r}"
        )


def gate_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """[L, 3 Hq, D]: the stacked HF g_proj weights of `cfg` (dense or NSA)."""
    return (cfg.num_layers, 3 * cfg.num_heads, cfg.hidden_size)


def nsa_model_config(cfg: ModelConfig, nsa_cfg: NSAConfig) -> ModelConfig:
    check_dense_llama(cfg)
    return cfg.replace(model_type="llama-nsa", nsa=nsa_cfg)


def to_nsa(cfg: ModelConfig, params: Params, nsa_cfg: NSAConfig, g_proj) -> tuple[ModelConfig, Params]:
    """The NSA model: `cfg` with `nsa_cfg`, and `params` with the gate columns appended to wqkv
    (g_proj [L, 3 Hq, D], HF layout; a zero gate bias where the model has qkv biases). The dense
    arrays are shared, not copied; only wqkv (and bqkv) are new."""
    nsa = nsa_model_config(cfg, nsa_cfg)
    if tuple(np.shape(g_proj)) != gate_shape(cfg):
        raise JaxspecError(f"g_proj has shape {list(np.shape(g_proj))}, the model needs {list(gate_shape(cfg))}")
    return nsa, _with_gates(params, jnp.asarray(g_proj))


def _with_gates(params: Params, g_proj: jax.Array) -> Params:
    layers = dict(params["layers"])
    dtype = layers["wqkv"].dtype
    layers["wqkv"] = jnp.concatenate([layers["wqkv"], jnp.swapaxes(g_proj, 1, 2).astype(dtype)], axis=-1)
    if "bqkv" in layers:
        zeros = jnp.zeros(layers["bqkv"].shape[:-1] + (g_proj.shape[1],), layers["bqkv"].dtype)
        layers["bqkv"] = jnp.concatenate([layers["bqkv"], zeros], axis=-1)
    return {**params, "layers": layers}


def gates_of(cfg: ModelConfig, params: Params) -> np.ndarray:
    """The float32 g_proj [L, 3 Hq, D] of an NSA model's params (inverse of `to_nsa`)."""
    gdim = decoder.gate_dim(cfg)
    return np.asarray(jnp.swapaxes(params["layers"]["wqkv"][..., -gdim:], 1, 2), np.float32)
