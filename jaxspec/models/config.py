"""Model configuration: one frozen, hashable dataclass, so it can be a static argument of `jax.jit`.

It covers the Llama family (Llama/SmolLM2, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm), Qwen3-MoE
(`qwen3_moe`: Qwen3's attention, routed experts in place of the MLP, `MoEConfig`), gpt-oss (`gpt_oss`:
biased attention with a learned sink logit per head, sliding-window layers between full ones, YaRN
RoPE, routed experts with biases and a clamped SwiGLU) and NSA-Llama
(`llama-nsa`, the format of NSA-1B: Llama plus Native Sparse Attention, `NSAConfig`), and is built
from a Hugging Face `config.json` dict or from GGUF metadata (see `jaxspec.loaders`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxspec.errors import JaxspecError
from pallas_kernels.moe import ACTIVATIONS as MOE_ACTIVATIONS
from pallas_kernels.router import RULES as MOE_ROUTERS

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "llama-nsa")
MOE_MODEL_TYPES = ("qwen3_moe", "gpt_oss")
NSA_TOPK_RULES = ("nsa1b", "exact")
MAX_NSA_BLOCK = 128  # compressed blocks tile the cache slots (kvcache.SLOT_ALIGN)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies: `default`, `linear`, `llama3` or `yarn` (the names and formulas of HF)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int = 0  # llama3 / yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin; None derives it from factor
    truncate: bool = True  # yarn

    def inverse_frequencies(self, head_dim: int) -> tuple[np.ndarray, float]:
        """Returns (inv_freq [head_dim // 2] float64, cos/sin scale), computed once on the host."""
        exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        inv_freq = 1.0 / self.theta**exponents
        if self.kind == "default":
            return inv_freq, 1.0
        if self.kind == "linear":
            return inv_freq / self.factor, 1.0
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled), 1.0
        if self.kind == "yarn":
            return self._yarn(inv_freq, head_dim)
        raise JaxspecError(f"unsupported rope scaling type {self.kind!r}")

    def _yarn(self, inv_freq: np.ndarray, head_dim: int) -> tuple[np.ndarray, float]:
        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = inv_freq / self.factor * (1 - extrapolation) + inv_freq * extrapolation
        scale = self.attention_factor
        if scale is None:
            scale = 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        return inv, float(scale)


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """Native Sparse Attention, as NSA-1B has it (`jaxspec.models.nsa`): compressed blocks of
    `block_size` tokens, the top `block_counts` blocks per query, a sliding window of `window_size`
    keys, gated per query head.

    `topk_rule` "nsa1b" is the rule of fla's `parallel_nsa_topk` kernel that NSA-1B was trained with:
    candidates are streamed in chunks of `block_size` compressed blocks and a running list keeps the
    top half of the earlier chunks plus the top half of the current chunk, so the result is the top-S
    of (exact top block_size/2 of the earlier chunks) + (top block_size/2 of the query's own chunk).
    "exact" is the exact top-S over all blocks. The query's own block is always selected; with
    S <= block_size/2 the two rules agree.

    `refresh_layers` is the calibrated refresh/reuse schedule of SSV's reuse precision classes (empty:
    none calibrated): the layers that compute their own selection; every other layer reuses the block
    indices of the nearest refresh layer before it and skips the compressed branch. Layer 0 refreshes.
    """

    block_size: int = 64
    block_counts: int = 16
    window_size: int = 512
    topk_rule: str = "nsa1b"
    refresh_layers: tuple[int, ...] = ()

    def __post_init__(self):
        bs = self.block_size
        if not (1 <= bs <= MAX_NSA_BLOCK and bs & (bs - 1) == 0):
            raise JaxspecError(f"NSA block_size must be a power of two <= {MAX_NSA_BLOCK}, got {bs}")
        if self.block_counts < 1:
            raise JaxspecError(f"NSA block_counts must be at least 1, got {self.block_counts}")
        if self.window_size < 0:
            raise JaxspecError(f"NSA window_size must be >= 0, got {self.window_size}")
        if self.topk_rule not in NSA_TOPK_RULES:
            raise JaxspecError(f"nsa_topk_rule must be one of {', '.join(NSA_TOPK_RULES)}, got {self.topk_rule!r}")
        object.__setattr__(self, "refresh_layers", tuple(int(i) for i in self.refresh_layers))  # JSON lists too
        layers = self.refresh_layers
        if layers and (layers[0] != 0 or list(layers) != sorted(set(layers))):
            raise JaxspecError(f"nsa_refresh_layers must be increasing layer indices starting at 0, got {list(layers)}")

    def reuse_source(self, num_layers: int) -> np.ndarray:
        """[num_layers] int32: the layer whose selection each layer uses (itself for a refresh layer)."""
        refresh = np.zeros(num_layers, bool)
        refresh[list(self.refresh_layers) or slice(None)] = True
        return np.maximum.accumulate(np.where(refresh, np.arange(num_layers), 0)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts in place of every layer's MLP (`jaxspec.models.moe`): `num_experts` experts of
    `expert_size` columns, `top_k` of them per token. `router` "softmax_topk" (Qwen3-MoE): softmax over
    all experts, the top k, renormalised to sum 1 when `norm_topk_prob`; "topk_softmax" (gpt-oss):
    the top k logits, softmaxed over those k. `activation` "silu": silu(gate) * up; "gpt_oss": the
    clamped SwiGLU of gpt-oss. `bias`: the router and the experts carry biases (gpt-oss)."""

    num_experts: int
    top_k: int
    expert_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    activation: str = "silu"
    bias: bool = False

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise JaxspecError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), got {self.top_k}")
        if self.expert_size < 1:
            raise JaxspecError(f"moe_intermediate_size must be positive, got {self.expert_size}")
        if self.router not in MOE_ROUTERS or self.activation not in MOE_ACTIVATIONS:
            raise JaxspecError(f"unknown MoE router {self.router!r} or activation {self.activation!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder; `dtype` is the parameter and KV-cache dtype."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    nsa: NSAConfig | None = None  # set for llama-nsa models only
    moe: MoEConfig | None = None  # set for mixture-of-experts models only: every layer's MLP is routed experts
    o_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    sinks: bool = False  # a learned sink logit per layer and query head in every softmax's denominator (gpt-oss)
    sliding_window: int = 0  # the keys a sliding-window layer sees: the last `sliding_window` positions
    sliding_layers: tuple[int, ...] = ()  # the layers that attend a sliding window (the others: every key)
    # tensor parallelism: > 1 makes this one shard's view of the model (`models.sharding.local_config`:
    # its heads and MLP columns, the model's vocabulary size), run per device under shard_map
    tp: int = 1
    # an MoE model under tensor parallelism: whole experts split across the devices, not every expert's
    # columns (`models.sharding.splits_experts` decides)
    expert_parallel: bool = False

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise JaxspecError(
                f"unsupported architecture {self.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
                 "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                 "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings}
        for name, size in sizes.items():
            if size < 1:
                raise JaxspecError(f"{name} must be at least 1, got {size}")
        if self.num_heads % self.num_kv_heads:
            raise JaxspecError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.dtype not in ("bfloat16", "float32"):
            raise JaxspecError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        if (self.model_type == "llama-nsa") != (self.nsa is not None):
            raise JaxspecError(f"model type {self.model_type!r} {'needs' if self.nsa is None else 'takes no'} NSA settings")
        if (self.model_type in MOE_MODEL_TYPES) != (self.moe is not None):
            raise JaxspecError(f"model type {self.model_type!r} {'needs' if self.moe is None else 'takes no'} MoE settings")
        if self.sliding_layers and not (self.sliding_window > 0 and max(self.sliding_layers) < self.num_layers):
            raise JaxspecError(f"sliding-window layers {list(self.sliding_layers)} need a positive sliding_window and "
                               f"layers below {self.num_layers}")
        if self.nsa is not None and self.nsa.window_size > self.max_position_embeddings:
            raise JaxspecError(
                f"NSA window_size {self.nsa.window_size} is larger than the context ({self.max_position_embeddings})"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict, dtype: str = "bfloat16") -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` dict (transformers 4.x and 5.x layouts)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise JaxspecError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                intermediate_size=int(hf["intermediate_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope=rope_from_hf(hf),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
                o_bias=model_type == "gpt_oss" and bool(hf.get("attention_bias", False)),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                sinks=model_type == "gpt_oss",
                sliding_window=int(hf.get("sliding_window") or 0) if model_type == "gpt_oss" else 0,
                sliding_layers=sliding_layers(hf) if model_type == "gpt_oss" else (),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                dtype=dtype,
                nsa=nsa_from_hf(hf) if model_type == "llama-nsa" else None,
                moe=moe_from_hf(hf) if model_type in MOE_MODEL_TYPES else None,
            )
        except KeyError as e:
            raise JaxspecError(f"config.json is missing {e.args[0]!r}") from None


def sliding_layers(hf: dict) -> tuple[int, ...]:
    """gpt-oss's sliding-window layers: `layer_types` (else every other layer from the first, its default)."""
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(int(hf["num_hidden_layers"]))]
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def moe_from_hf(hf: dict) -> MoEConfig:
    """gpt-oss: `num_local_experts` experts of `intermediate_size`, `num_experts_per_tok` a token, the
    router's top-k logits softmaxed, biases, the clamped SwiGLU. Qwen3-MoE's keys: `num_experts` (or
    `num_local_experts`), `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob` (false when
    absent, as transformers reads it); every layer must be an MoE layer (`decoder_sparse_step` 1, no
    `mlp_only_layers`), as in the released Qwen3-MoE models: one stacked layer scan has one MLP kind."""
    if hf["model_type"] == "gpt_oss":
        return MoEConfig(num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                         expert_size=int(hf["intermediate_size"]), router="topk_softmax", norm_topk_prob=False,
                         activation="gpt_oss", bias=True)
    step, dense = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise JaxspecError(f"models mixing dense and MoE layers are not supported (decoder_sparse_step {step}, "
                           f"mlp_only_layers {dense})")
    experts = hf.get("num_experts") or hf["num_local_experts"]  # the released configs' name, transformers 5's
    return MoEConfig(num_experts=int(experts), top_k=int(hf["num_experts_per_tok"]),
                     expert_size=int(hf["moe_intermediate_size"]), norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def nsa_from_hf(hf: dict) -> NSAConfig:
    """NSA-1B's keys: `block_size`, `block_counts`, `window_size`; optional `nsa_topk_rule` and
    `nsa_refresh_layers` (jaxspec's calibrated refresh/reuse schedule)."""
    return NSAConfig(
        block_size=int(hf["block_size"]),
        block_counts=int(hf["block_counts"]),
        window_size=int(hf["window_size"]),
        topk_rule=hf.get("nsa_topk_rule", "nsa1b"),
        refresh_layers=hf.get("nsa_refresh_layers") or (),
    )


def nsa_hf_keys(nsa: NSAConfig) -> dict:
    """NSA-1B's keys of `nsa`'s attention settings (`nsa_from_hf` reads them back; the refresh/reuse
    schedule is written apart: a gate file records these keys, which the schedule does not change)."""
    return {"block_size": nsa.block_size, "block_counts": nsa.block_counts, "window_size": nsa.window_size,
            "nsa_topk_rule": nsa.topk_rule}


def rope_from_hf(hf: dict) -> RopeConfig:
    """Reads `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4)."""
    params = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        params = {**hf["rope_scaling"], **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind not in ("linear", "llama3", "yarn"):
        raise JaxspecError(f"unsupported rope scaling type {kind!r}")
    original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 0)
    factor = params.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if kind == "yarn" and attention_factor is None and mscale and mscale_all_dim:

        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(factor),
        original_max_position=int(original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )
