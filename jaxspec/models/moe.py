"""Mixture-of-experts layers: a router picks `top_k` of `num_experts` experts per token, and the
layer's output is the routed experts' SwiGLU outputs weighted by the router (`config.MoEConfig`).

    ids, weights = route(moe, h, router, router_bias)     the k experts of each row and their weights
    y = experts(moe, h, layer_params, stacks, entry, ...)  the layer's output, float32 [B, T, D]

The experts' stacks [L, E, ...] are read in place at the layer's entry by the experts kernel
(pallas_kernels.moe_experts): a layer's slice of them would be copied first, and a decode step reads
only the experts its rows were routed to; an MXFP4 stack (gpt-oss's released experts, kept packed)
is decoded in the kernel's registers. Routing is computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.models.config import MoEConfig

EXPERT_STACKS = ("moe_gate_up", "moe_down", "moe_gate_up_bias", "moe_down_bias")  # [L, E, ...]: read in place


def param_shapes(moe: MoEConfig, L: int, D: int) -> dict[str, tuple[int, ...]]:
    """The MoE layer's params (the router scanned with the layer, the experts' stacks read in place)."""
    E, F = moe.num_experts, moe.expert_size
    shapes = {"router": (L, D, E), "moe_gate_up": (L, E, D, 2 * F), "moe_down": (L, E, F, D)}
    if moe.bias:
        shapes.update(router_bias=(L, E), moe_gate_up_bias=(L, E, 2 * F), moe_down_bias=(L, E, D))
    return shapes


def route(moe: MoEConfig, h: jax.Array, router: jax.Array, router_bias: jax.Array | None = None):
    """(expert ids [N, k] int32, weights [N, k] float32) of the rows h [..., D] (N of them)."""
    logits = jnp.dot(h.reshape(-1, h.shape[-1]), router, preferred_element_type=jnp.float32)
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    if moe.router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, moe.top_k)
        return ids, jax.nn.softmax(top, axis=-1)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), moe.top_k)
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def experts(moe: MoEConfig, h: jax.Array, layer: dict, stacks: dict, entry: jax.Array, backend: str) -> jax.Array:
    """The MoE layer's output float32 [B, T, D] for the normed stream h [B, T, D]: `layer` holds this
    layer's router (a slice of the scan), `stacks` the experts' whole stacks, read at `entry`."""
    B, T, D = h.shape
    ids, weights = route(moe, h, layer["router"], layer.get("router_bias"))
    out = kernels.moe_experts(h.reshape(B * T, D), ids, weights, stacks["moe_gate_up"], stacks["moe_down"], entry,
                              b_gate_up=stacks.get("moe_gate_up_bias"), b_down=stacks.get("moe_down_bias"),
                              activation=moe.activation, backend=backend)
    return out.reshape(B, T, D)
