"""Mixture-of-experts layers: a router picks `top_k` of `num_experts` experts per token, and the
layer's output is the routed experts' SwiGLU outputs weighted by the router (`config.MoEConfig`).

    ids, weights = route(moe, h, router, router_bias, entry, backend)   each row's k experts and weights
    y = experts(cfg, h, layer_params, stacks, entry, ...)  the layer's output, float32 [B, T, D]

The experts' stacks [L, E, ...] are read in place at the layer's entry by the experts kernel
(pallas_kernels.moe_experts): a layer's slice of them would be copied first, and a decode step reads
only the experts its rows were routed to; an MXFP4 stack (gpt-oss's released experts, kept packed)
is decoded in the kernel's registers. Routing is computed in float32: XLA's product, then the bias
(read in place too) and the choice of the top k in one kernel (pallas_kernels.moe_route).

Tensor parallelism (`jaxspec.models.sharding`) splits every expert's columns as the dense MLP's: a
device holds the gate and up columns [gate_s | up_s] of every expert and the matching rows of its
down matrix, so each device reads 1/tp of each routed expert at any row count, through the dense
model's layout and its one all-reduce after the down product. The router is replicated: every
device routes identically. Packed (MXFP4) experts split the same way, as bytes and scales, when each
device's down rows are whole 32-value scale groups (gpt-oss-20b: --tp 2). Where they are not
(gpt-oss-20b at --tp 4), whole experts split across the devices instead (`ModelConfig.expert_parallel`):
every device routes every row, keeps the assignments to its own experts (`sharding.local_experts`;
the kernel drops the others) and adds their down biases, and the all-reduce sums the shares. Which
split is faster on GPUs is not measured yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.models import sharding
from jaxspec.models.config import ModelConfig, MoEConfig

# [L, E, ...]: read in place at the layer's entry by the kernels (the router's choice, the experts)
STACKS = ("router_bias", "moe_gate_up", "moe_down", "moe_gate_up_bias", "moe_down_bias")


def param_shapes(moe: MoEConfig, L: int, D: int) -> dict[str, tuple[int, ...]]:
    """The MoE layer's params (the router scanned with the layer; its bias and the experts' stacks, STACKS,
    read in place)."""
    E, F = moe.num_experts, moe.expert_size
    shapes = {"router": (L, E, D), "moe_gate_up": (L, E, D, 2 * F), "moe_down": (L, E, F, D)}
    if moe.bias:
        shapes.update(router_bias=(L, E), moe_gate_up_bias=(L, E, 2 * F), moe_down_bias=(L, E, D))
    return shapes


def route(moe: MoEConfig, h: jax.Array, router: jax.Array, router_bias: jax.Array | None = None,
          entry: jax.Array | None = None, backend: str = "reference"):
    """(expert ids [N, k] int32, weights [N, k] float32) of the rows h [..., D] (N of them), the
    router [E, D], the checkpoint's own layout, and its bias stack [L, E] at `entry` (int32 scalar).
    XLA turns a decode step's one-row product into a reduction over D: over the major axis of a [D, E]
    router only E outputs share the work (gpt-oss-20b's 32 took 26 µs a layer on an H100), along the
    minor axis each output is a row of its own (bench/NOTES.md, "where an MoE plain step goes", "the
    router in the checkpoint's own layout")."""
    logits = jnp.einsum("nd,ed->ne", h.reshape(-1, h.shape[-1]), router, preferred_element_type=jnp.float32)
    return kernels.moe_route(logits, moe.top_k, moe.router, moe.norm_topk_prob, router_bias, entry, backend=backend)


def experts(cfg: ModelConfig, h: jax.Array, layer: dict, stacks: dict, entry: jax.Array, backend: str) -> jax.Array:
    """The MoE layer's output float32 [B, T, D] for the normed stream h [B, T, D] (under tensor
    parallelism this device's share of it, summed by the caller's all-reduce): `layer` holds this
    layer's router (a slice of the scan), `stacks` the whole STACKS, read at `entry`. With
    every expert's columns split over devices, the routed down bias is a replicated term: shard 0
    alone adds it, so the sum counts it once and stays a float32 sum of the kernel's own terms (no
    change to the all-reduce)."""
    B, T, D = h.shape
    ids, weights = route(cfg.moe, h, layer["router"], stacks.get("router_bias"), entry, backend)
    ids = sharding.local_experts(ids, stacks["moe_down"].shape[1], cfg)
    b_down = stacks.get("moe_down_bias")
    whole = cfg.tp == 1 or cfg.expert_parallel  # each assignment's down bias added where it is computed
    out = kernels.moe_experts(h.reshape(B * T, D), ids, weights, stacks["moe_gate_up"], stacks["moe_down"], entry,
                              b_gate_up=stacks.get("moe_gate_up_bias"), b_down=b_down if whole else None,
                              activation=cfg.moe.activation, backend=backend)
    if b_down is not None and not whole:
        bias = jnp.einsum("nkd,nk->nd", b_down[entry, ids].astype(jnp.float32), weights,
                          precision=jax.lax.Precision.HIGHEST)
        out = out + sharding.first_shard_only(bias, cfg)
    return out.reshape(B, T, D)
