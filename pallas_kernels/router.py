"""An MoE router's choice from its logits in one kernel: each row's top k experts and their weights.

Rules (`jaxspec.models.config.MoEConfig.router`): "softmax_topk" (Qwen3-MoE) takes the k largest of the
softmax over all E experts, renormalised over the k when `norm`; "topk_softmax" (gpt-oss) softmaxes the k
largest logits. Ties go to the lower expert id, as `lax.top_k` breaks them.

Why a kernel: XLA ran a decode step's choice as four kernels a layer after the router's product (a
softmax, a copy, a sort for the top k, a second softmax: 6.6 µs a layer on an H100 at Qwen3-30B-A3B's
shapes, 4.2 at gpt-oss-20b's; bench/NOTES.md, "where an MoE plain step goes"). One program a row holds
its E logits in registers and takes the k largest one at a time (the largest, its lowest id, masked out).
Softmax is monotonic, so "softmax_topk" picks from the logits too and needs only the k probabilities.
A router's bias (gpt-oss) is added in the kernel, read in place from its stack [L, E] at the layer: added
by XLA it was a kernel of its own (1.5 µs a layer on an H100, bench/NOTES.md, "the router's bias in the
choice kernel"), and its slice passed to the kernel would be copied first.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_pow2

RULES = ("softmax_topk", "topk_softmax")
MAX_EXPERTS = 1024  # a row's logits in one program's registers; more experts run the reference


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown MoE router {rule!r}: expected one of {RULES}")


def route_reference(logits, k: int, rule: str, norm: bool, bias=None, layer=None):
    """(ids [N, k] int32, weights [N, k] float32) of float32 logits [N, E], by `rule` (module docstring);
    with `bias`, a stack [L, E], the logits plus its entry `layer` (an int32 scalar)."""
    _check_rule(rule)
    if bias is not None:
        logits = logits + bias[layer].astype(jnp.float32)
    if rule == "topk_softmax":
        top, ids = lax.top_k(logits, k)
        return ids, jax.nn.softmax(top, axis=-1)
    weights, ids = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    return ids, weights / jnp.sum(weights, axis=-1, keepdims=True) if norm else weights


def _kernel(logits_ref, *refs, k: int, rule: str, norm: bool, biased: bool):
    """Program n: row n's choice."""
    layer_ref, bias_ref, ids_ref, weights_ref = refs if biased else (None, None, *refs)
    n = pl.program_id(0)
    E = logits_ref.shape[1]
    width, slots = next_pow2(E), next_pow2(k)
    cols, slot = jnp.arange(width), jnp.arange(slots)
    x = plgpu.load(logits_ref.at[n, pl.ds(0, width)], mask=cols < E, other=-jnp.inf)
    if biased:
        x = x + plgpu.load(bias_ref.at[layer_ref[0], pl.ds(0, width)], mask=cols < E, other=0.0).astype(jnp.float32)
    ids, top, left = jnp.zeros((slots,), jnp.int32), jnp.full((slots,), -jnp.inf, jnp.float32), x
    for j in range(k):
        best = jnp.max(left)
        at = jnp.min(jnp.where(left == best, cols, width))  # the lowest id of the largest left
        ids, top = jnp.where(slot == j, at, ids), jnp.where(slot == j, best, top)
        left = jnp.where(cols == at, -jnp.inf, left)
    first = jnp.max(x)  # the largest logit: top's first
    e = jnp.where(slot < k, jnp.exp(top - first), 0.0)
    if rule == "topk_softmax" or norm:
        weights = e / jnp.sum(e)
    else:
        weights = e / jnp.sum(jnp.exp(x - first))
    plgpu.store(ids_ref.at[n, pl.ds(0, slots)], ids, mask=slot < k)
    plgpu.store(weights_ref.at[n, pl.ds(0, slots)], weights, mask=slot < k)


def route_pallas(logits, k: int, rule: str, norm: bool, bias=None, layer=None, *, interpret: bool = False):
    """Pallas-Triton kernel: grid (N,), one row a program; E <= MAX_EXPERTS; `bias` [L, E] read in place
    at `layer`."""
    _check_rule(rule)
    N, E = logits.shape
    if not 1 <= k <= E <= MAX_EXPERTS:
        raise ValueError(f"route_pallas takes 1 <= k <= E <= {MAX_EXPERTS}, got k {k}, E {E}")
    biased = [] if bias is None else [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), bias]
    args = [logits.astype(jnp.float32), *biased]
    return pl.pallas_call(
        functools.partial(_kernel, k=k, rule=rule, norm=norm, biased=bool(biased)), grid=(N,),
        in_specs=[pl.no_block_spec] * len(args), out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((N, k), jnp.int32), jax.ShapeDtypeStruct((N, k), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=1 if next_pow2(E) <= 256 else 4, num_stages=1),
        interpret=interpret, name="moe_route",
    )(*args)
