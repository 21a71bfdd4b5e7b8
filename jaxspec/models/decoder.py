"""The decoder: pure functions over a params pytree, one `lax.scan` over stacked layers.

Params layout (x @ W convention; L = num_layers, D = hidden, F = intermediate, Dh = head_dim):
    embed [V, D], final_norm [D], lm_head [D, V] (absent when embeddings are tied),
    layers: attn_norm [L, D], wqkv [L, D, (Hq + 2 Hkv) Dh (+ 3 Hq)] (q, k, v side by side, then for NSA
            models the gate logits, (compressed, selected, window) per query head), wo [L, Hq*Dh, D],
            bqkv [L, (Hq + 2 Hkv) Dh] (qkv_bias only), bo [L, D] (o_bias only), sinks [L, Hq]
            (sinks only), q_norm/k_norm [L, Dh] (qk_norm only),
            mlp_norm [L, D], w_gate_up [L, D, 2F] (gate then up), w_down [L, F, D];
            mixture-of-experts models (cfg.moe) have instead router [L, E, D] (router_bias [L, E]) and
            the experts' moe_gate_up [L, E, D, 2Fe], moe_down [L, E, Fe, D] (either an MXFP4 stack in
            gpt-oss's released form, pallas_kernels.mxfp4.MXFP4; with biases moe_gate_up_bias
            [L, E, 2Fe], moe_down_bias [L, E, D]): `jaxspec.models.moe`.
The q/k/v and gate/up projections are fused because a decode step multiplies one or a few rows by
each matrix: one product per layer reads the weights at about twice the bandwidth of three small
ones (bench/NOTES.md, "Decode step").

A layer (`forward`) reads as the transformer layer it is, one named step each, the fused kernel of
each step behind it:
    q, cache, gates = attention_inputs(h, ...)      q/k/v product; bias, qk-norm, RoPE, cache write
    out = attend(q, cache, gates, ...)               attention (the injected backend)
    x, h = residual_add_norm(x, out, wo, mlp_norm)   residual, then the MLP's norm
    x, h = residual_add_norm(x, swiglu(h), w_down, next_norm)   residual, then the next layer's norm
                                                     (an MoE layer: its routed experts' output instead)
Each residual add is fused with the norm that follows it (kernels.residual_norm), so the stream
arrives at a layer already normed (h; the first layer's norm runs before the loop, the last one's
norm is the final norm).

The cache write comes before the injected `attend`, so prefill, plain decoding, verification (with
score collection) and sparse drafting share one model and differ only in how attention reads the
cache. `attention` picks the model's own attention (full causal, or NSA's three gated branches:
`jaxspec.models.nsa`). `sequence_forward` runs the same layers without a KV cache, for training.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as kernels
from jaxspec.errors import JaxspecError
from jaxspec.models import moe, nsa, sharding
from jaxspec.models.config import ModelConfig
from jaxspec.models.kvcache import KVCache, init_cache
from jaxspec.models.quantize import Quantized
from pallas_kernels.row_matmul import product_rows
from pallas_kernels.rope_write import apply_rope, rms_norm  # noqa: F401 (the layer's math, beside its kernel)

Params = dict[str, Any]
# attend(layer, q [B,T,Hq,Dh], cache, layer_x, gates, carry) -> (out [B,T,Hq,Dh], layer_y, carry);
# gates are the model's attention inputs besides q and the cache: NSA's sigmoid gates [B,T,Hq,3],
# gpt-oss's `SinkWindow`, else None (attention that is not that model's ignores them); carry goes
# from layer to layer (NSA reuse layers take an earlier layer's selection from it)
AttendFn = Callable[[jax.Array, jax.Array, KVCache, Any, Any, Any], tuple[jax.Array, Any, Any]]


def gate_dim(cfg: ModelConfig) -> int:
    """Columns of the NSA gate projection inside wqkv (0 for dense models)."""
    return 3 * cfg.num_heads if cfg.nsa else 0


def param_shapes(cfg: ModelConfig) -> Params:
    """The exact shapes of a params pytree for `cfg` (loaders and tests check against it)."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": (L, D),
        "wqkv": (L, D, q_dim + 2 * kv_dim + gate_dim(cfg)),
        "wo": (L, q_dim, D),
        "mlp_norm": (L, D),
    }
    if cfg.moe is None:
        layers.update(w_gate_up=(L, D, 2 * F), w_down=(L, F, D))
    else:
        layers.update(moe.param_shapes(cfg.moe, L, D))
    if cfg.qkv_bias:
        layers.update(bqkv=(L, q_dim + 2 * kv_dim + gate_dim(cfg)))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.o_bias:
        layers.update(bo=(L, D))
    if cfg.sinks:
        layers.update(sinks=(L, cfg.num_heads))
    shapes = {"embed": (V, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


LAYERWISE_INIT_ELEMENTS = 1 << 28  # a larger random stack is drawn a layer at a time (no whole float32 copy)


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random weights (normal * scale, norms near 1) at the config's shapes, e.g. Qwen3-8B for latency.
    A stack over LAYERWISE_INIT_ELEMENTS (an MoE model's experts: Qwen3-30B-A3B's are 19G elements)
    is drawn layer by layer into its final dtype."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(flat))
    dtype = jnp.dtype(cfg.dtype)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def make(k, shape, is_norm):
        if math.prod(shape) > LAYERWISE_INIT_ELEMENTS:
            return jax.lax.map(lambda k: make(k, shape[1:], is_norm), jax.random.split(k, shape[0]))
        noise = jax.random.normal(k, shape, jnp.float32)
        return (1.0 + 0.1 * noise if is_norm else scale * noise).astype(dtype)

    leaves = [make(k, shape, "norm" in jax.tree_util.keystr(path)) for (path, shape), k in zip(flat, keys)]
    return jax.tree.unflatten(treedef, leaves)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    inv_freq, scale = cfg.rope.inverse_frequencies(cfg.head_dim)
    return inv_freq.astype(np.float32), scale


def embed(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    return sharding.embed(params["embed"], tokens, cfg)


# Matrices under this many elements get a one-row product's row twice, where the row kernel does not
# take them (kernels.row_matmul_reads_exact): XLA runs a small matrix's one-row product as slow
# multiply + reduce fusions, and two rows make it a gemm; larger matrices are gemms already, where the
# copy would only add a kernel. A bound from the measured shapes, not XLA's own rule (bench/NOTES.md,
# "fused layer projections (not kept) and one-row gemms").
REDUCED_ONE_ROW_ELEMENTS = 1 << 24
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's matrices


@dataclasses.dataclass(frozen=True)
class InPlace:
    """An exact stacked matrix [L, K, N] that the row kernel reads in place at `layer`, as it reads a
    `Quantized` one: `forward` hands the small matrices of a decode step's few rows so
    (kernels.row_matmul_reads_exact), instead of XLA's products of their scanned slices."""

    values: jax.Array
    layer: jax.Array
    backend: str
    scale = None  # exact: no scale (not a field)


def row_kernel_matrix(w: jax.Array, x: jax.Array, backend: str) -> jax.Array | InPlace:
    """A matrix w [K, N] outside the layer stack (a draft head's) as a one-entry `InPlace` stack where
    the row kernel reads it for the rows of x [..., K] (kernels.row_matmul_reads_exact), else w: XLA's
    product of a few rows ran pad and copy kernels around each gemm (bench/NOTES.md, "the head's kernels")."""
    stack = w[None]
    rows = math.prod(x.shape[:-1])
    return InPlace(stack, jnp.int32(0), backend) if kernels.row_matmul_reads_exact(stack, rows, backend) else w


def matmul(x: jax.Array, w: jax.Array | Quantized | InPlace, out_dtype=None) -> jax.Array:
    """x [..., K] @ w [K, N], a single row given twice where XLA would rewrite a one-row product.

    XLA on a GPU rewrites one-row products: with a float32 result it converts the whole matrix to
    float32 first (the LM head several times slower: bench/NOTES.md, "Decode step"), and a small matrix's
    product becomes multiply + reduce fusions. With two rows it is a gemm that reads the matrix in
    place (REDUCED_ONE_ROW_ELEMENTS says which matrices). A quantized matrix (a draft's copy,
    `draft_weights.Quantized`) or an `InPlace` one goes to the row kernel, which reads it in place.
    """
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(w, (Quantized, InPlace)):
        out = kernels.row_matmul(rows, w.values, w.scale, out_dtype or x.dtype, layer=w.layer, backend=w.backend)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    n = rows.shape[0]
    if n == 1 and (out_dtype is not None or w.size < REDUCED_ONE_ROW_ELEMENTS):
        rows = jnp.concatenate([rows, rows])
    return jnp.dot(rows, w, preferred_element_type=out_dtype)[:n].reshape(*x.shape[:-1], w.shape[-1])


def product_sums(x: jax.Array, w: jax.Array | Quantized | InPlace) -> tuple[jax.Array, jax.Array | None]:
    """x [B, T, K] @ w as (partial sums [S, R >= B*T, N], column scales [E, N] or None): the form
    rope_write reads, so that the row kernel's split sum and scales need no kernel of their own
    (pallas_kernels.row_matmul_partials); XLA's product is its own single sum."""
    if isinstance(w, (Quantized, InPlace)):
        return kernels.row_matmul_partials(x.reshape(-1, x.shape[-1]), w.values, w.scale, layer=w.layer,
                                           backend=w.backend)
    return matmul(x, w).reshape(1, -1, w.shape[-1]), None


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final norm and LM head; float32 logits [..., V]."""
    return output_logits(params, cfg, rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps))


def output_logits(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """The LM head (or the tied embedding) over normed rows h [..., D]: float32 logits [..., V] (an
    EAGLE head that shares the target's LM head reads it here too)."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T  # a draft's int8 head too
    return sharding.gather_vocab(matmul(h, head, jnp.float32), cfg)


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    cache: KVCache,
    attend: AttendFn,
    layer_xs: Any = None,
    slots: jax.Array | None = None,
    carry: Any = (),
    layer_ids: np.ndarray | jax.Array | None = None,
    backend: str = "reference",
    remat: bool = False,
    capture: tuple[int, ...] = (),
) -> tuple[jax.Array, KVCache, Any] | tuple[jax.Array, KVCache, Any, jax.Array]:
    """Runs all layers on `tokens` [B, T] at `positions` [B, T] (RoPE).

    Keys/values of tokens with `valid` [B, T] true are written into the cache at `slots` [B, T]
    (default: their positions; a draft tree's nodes share positions and differ in slots) before
    `attend` reads it; invalid tokens (padding) write nothing. `layer_xs` is a pytree with a leading
    layer axis handed to `attend` one layer at a time; `attend`'s per-layer outputs come back stacked;
    `carry` is `attend`'s initial layer-to-layer state. `layer_ids` are the cache layers of the
    entries of params' layer stack (a draft that skips layers, `draft_weights`: the layers it keeps;
    `sequence_forward`: 0, its one-layer cache; default: every layer); quantized matrices, norms and
    the per-head parameters are read in place at their stack entry. `backend` runs the layer's fused
    kernels (kernels.rope_write, kernels.residual_norm); with the Pallas backend a few rows' products
    with small exact matrices run the row kernel too (`InPlace`). `remat` recomputes each layer in
    the backward pass (training). Returns the last hidden states [B, T, D] (before the final norm),
    the cache, and `attend`'s per-layer outputs; with `capture` (model layers, static) a fourth
    value, the residual stream entering each of those layers concatenated in the order given,
    [B, T, len(capture) * D] (transformers' `hidden_states[i]`, 0 the embeddings: EAGLE-3's
    features). Without it the program is the one it always was.
    """
    B, T = tokens.shape
    write_pos = jnp.where(valid, positions if slots is None else slots, cache.num_slots)  # past the end: not written
    write_slots = cache.slots(write_pos)  # in the pool: every layer's, looked up once

    # Read in place at the layer's entry by the kernels (a slice of a stack passed to a kernel would be
    # copied first: a kernel a layer); the rest is sliced by the scan inside XLA's fusions. A layer's
    # MLP output ends in the next layer's norm (the last one's in the final norm): next_norm.
    layers = params["layers"]
    in_place = {name: m for name, m in layers.items() if isinstance(m, Quantized)
                or (name in MATRICES and kernels.row_matmul_reads_exact(m, B * T, backend))}
    stacks = {name: layers.get(name) for name in ("bqkv", "q_norm", "k_norm", "mlp_norm", "sinks")}
    stacks["next_norm"] = jnp.concatenate([layers["attn_norm"][1:], params["final_norm"][None]])
    experts = {name: a for name, a in layers.items() if name in moe.STACKS}  # read in place by the kernels
    scanned = {name: a for name, a in layers.items() if name not in in_place and name not in stacks
               and name not in experts and name != "attn_norm"}
    num_entries = layers["attn_norm"].shape[0]

    def layer(state, xs):
        x, h, cache, carry, entry = state  # h: the stream x, normed for this layer's attention
        p, cache_layer, lx = xs
        cache_layer = entry if cache_layer is None else cache_layer
        p = {**p, **{name: dataclasses.replace(m, layer=entry) if isinstance(m, Quantized) else InPlace(m, entry, backend)
                     for name, m in in_place.items()}}
        q, cache, gates = attention_inputs(cfg, h, p["wqkv"], stacks, entry, positions, write_pos, write_slots, cache,
                                           cache_layer, backend)
        if cfg.sinks:  # gpt-oss: its attention's inputs besides q and the cache
            gates = layer_sink_window(cfg, stacks["sinks"], positions, cache_layer)
        out, ly, carry = attend(cache_layer, q, cache, lx, gates, carry)
        if cfg.o_bias:
            x = x + p["bo"]
        x, h = residual_add_norm(cfg, x, out.reshape(B, T, -1), p["wo"], stacks["mlp_norm"], entry, backend)
        if cfg.moe is None:
            x, h = residual_add_norm(cfg, x, swiglu(h, p["w_gate_up"]), p["w_down"], stacks["next_norm"], entry, backend)
        else:
            x, h = residual_add_norm(cfg, x, moe.experts(cfg, h, p, experts, entry, backend), None, stacks["next_norm"],
                                     entry, backend)
        return (x, h, cache, carry, entry + 1), ly

    if remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    x = embed(params, cfg, tokens)
    h = rms_norm(x, layers["attn_norm"][0], cfg.rms_norm_eps)
    # The entry is a counter in the carry, which XLA merges with the loop's own: the kernels read it
    # in place. An iota among the scanned inputs was sliced by a copy kernel every layer (and so is
    # layer_ids, passed only for a draft that skips layers).
    ids = None if layer_ids is None else jnp.asarray(layer_ids, jnp.int32)
    xs, state = (scanned, ids, layer_xs), (x, h, cache, carry, jnp.int32(0))
    if not capture:
        (x, _, cache, _, _), layer_ys = jax.lax.scan(layer, state, xs, length=num_entries)
        return x, cache, layer_ys
    # Captured: the layers run as loops that end before each captured entry, whose input is taken
    # between them (a write into a buffer inside the one scan cost a kernel in every layer). Each loop
    # counts the entry itself from a constant, so XLA knows its trip count and keeps no second counter
    # (a scan's own counter beside an entry from lo > 0 cost an add kernel a layer). While loops are
    # not reverse-differentiable: capture serves inference and the training's teacher.
    entries = capture_entries(capture, layer_ids, num_entries)
    at = lambda entry: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, entry, 0, False), xs)
    ys = jax.tree.map(lambda y: jnp.zeros((num_entries, *y.shape), y.dtype), jax.eval_shape(layer, state, at(0))[1])

    def step(loop):  # one layer; its output into the stack at its entry
        state, ys = loop
        entry = state[4]
        state, ly = layer(state, at(entry))
        return state, jax.tree.map(lambda stack, y: jax.lax.dynamic_update_index_in_dim(stack, y, entry, 0), ys, ly)

    taken = {}
    for lo, hi in zip([0, *sorted(entries)], [*sorted(entries), num_entries]):
        state = (*state[:4], jnp.int32(lo))  # a constant start: a known trip count
        if hi > lo:
            state, ys = jax.lax.while_loop(lambda loop, hi=hi: loop[0][4] < hi, step, (state, ys))
        taken[hi] = state[0]
    features = jnp.concatenate([taken[e] for e in entries], axis=-1)  # [B, T, n * D], in capture's order
    return state[0], state[2], ys, features


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SinkWindow:
    """gpt-oss attention's inputs besides q and the cache, handed to `attend` in NSA's gates' place:
    the model's sink logits [L, Hq] (the kernels read the attended layer's row in place), the lowest
    cache slot each query row sees [B, T] (a sliding-window layer's position - W + 1, 0 on
    full-attention layers) and whether this layer slides (a traced bool)."""

    sinks: jax.Array
    lo: jax.Array
    sliding: jax.Array


def sink_window(gates) -> dict:
    """The attention kernels' `sinks` and `lo` arguments from an attend's gates (none unless gpt-oss's)."""
    return {"sinks": gates.sinks, "lo": gates.lo} if isinstance(gates, SinkWindow) else {}


def layer_sink_window(cfg: ModelConfig, sinks: jax.Array, positions: jax.Array, layer: jax.Array) -> SinkWindow:
    """Model layer `layer`'s (traced) `SinkWindow` for rows at `positions` [B, T]: on
    `cfg.sliding_layers` a row sees slots from the window's first, position - W + 1, else all. A
    committed key's slot is its position, and a draft tree's own keys lie within any window larger
    than its depth."""
    sliding = jnp.asarray(np.isin(np.arange(cfg.num_layers), cfg.sliding_layers))[layer]
    return SinkWindow(sinks, jnp.where(sliding, window_start(positions, cfg.sliding_window), 0), sliding)


def window_start(positions: jax.Array, window: int) -> jax.Array:
    """int32 [B, T]: the lowest cache slot rows at `positions` see through a sliding window of `window`
    keys (a committed key's slot is its position)."""
    return jnp.maximum(positions - window + 1, 0).astype(jnp.int32)


def capture_entries(capture: tuple[int, ...], layer_ids, num_entries: int) -> list[int]:
    """The layer-stack entry of each of `forward`'s `capture` layers, in its order (a model layer's
    entry: where `layer_ids` holds it, or its index). One-line errors for a layer the stack does not
    hold (a draft's skipped layer) or one given twice."""
    layers = np.arange(num_entries) if layer_ids is None else np.asarray(layer_ids)
    entries = []
    for k, i in enumerate(capture):
        found = np.flatnonzero(layers == i)
        if i in capture[:k]:
            raise JaxspecError(f"capture: layer {i} is given twice")
        if len(found) != 1:
            raise JaxspecError(f"capture: layer {i} is not one of this forward's layers {layers.tolist()} (a skipped "
                               f"layer has no input to capture)")
        entries.append(int(found[0]))
    return entries


def attention_inputs(cfg: ModelConfig, h: jax.Array, wqkv, stacks: dict, entry: jax.Array, positions: jax.Array,
                     write_pos: jax.Array, write_slots: jax.Array, cache: KVCache, cache_layer: jax.Array,
                     backend: str) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Self-attention's inputs from the normed stream h [B, T, D]: q [B, T, Hq, Dh], the cache with the
    layer's keys and values written at logical slots `write_pos` (pool slots `write_slots`:
    `KVCache.slots`) of layer `cache_layer`, and NSA's sigmoid
    gates [B, T, Hq, 3] (None for dense models). Behind the fused q/k/v product one kernel adds the
    bias, normalises q and k per head (qk_norm), rotates them and writes k and v (kernels.rope_write);
    `stacks`' bqkv, q_norm and k_norm are read at `entry`."""
    B, T = positions.shape
    inv_freq, rope_scale = rope_tables(cfg)
    sums, scale = product_sums(h, wqkv)
    q, k_cache, v_cache = kernels.rope_write(
        sums, positions, write_slots, cache.k, cache.v, entry, cache_layer, inv_freq, num_heads=cfg.num_heads,
        rope_scale=rope_scale, eps=cfg.rms_norm_eps, page_size=cache.page_size, scale=scale, bias=stacks["bqkv"],
        q_norm=stacks["q_norm"], k_norm=stacks["k_norm"], backend=backend)
    cache = cache.written(cache_layer, write_pos, k_cache, v_cache)
    if not cfg.nsa:
        return q, cache, None
    qkv = product_rows(sums, scale, entry, B * T, h.dtype, stacks["bqkv"])
    gate_logits = qkv[:, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim:]  # after q, k and v
    return q, cache, jax.nn.sigmoid(gate_logits.astype(jnp.float32)).reshape(B, T, cfg.num_heads, 3)


def residual_add_norm(cfg: ModelConfig, x: jax.Array, y: jax.Array, w, norm: jax.Array, entry: jax.Array,
                      backend: str) -> tuple[jax.Array, jax.Array]:
    """(x + y @ w, its RMSNorm with norm[entry]): a sublayer's output projection added to the residual
    stream x [B, T, D], and the new stream normed for the next sublayer, in one kernel that sums the
    product's partial sums itself (kernels.residual_norm). `w` None: y is the sublayer's output
    itself (float32 [B, T, D]: an MoE layer's). Under tensor parallelism the product is summed over
    the shards first."""
    B, T = x.shape[:2]
    sums, scale = product_sums(y, w) if w is not None else (y.reshape(1, B * T, -1), None)
    if cfg.tp > 1:
        sums, scale = sharding.all_reduce(product_rows(sums, scale, entry, B * T, y.dtype), cfg)[None], None
    return kernels.residual_norm(x, sums, norm, entry, eps=cfg.rms_norm_eps, scale=scale, backend=backend)


def swiglu(h: jax.Array, w_gate_up) -> jax.Array:
    """The MLP's activations silu(h W_gate) * (h W_up) [..., F]; its down projection is
    `residual_add_norm`'s product."""
    gate, up = jnp.split(matmul(h, w_gate_up), 2, axis=-1)
    return jax.nn.silu(gate) * up


# attend_sequence(q [B, T, Hq, Dh], k [B, T, Hkv, Dh], v [B, T, Hkv, Dh], gates [B, T, Hq, 3] or None)
# -> out [B, T, Hq, Dh]: causal attention of a whole sequence from position 0
SequenceAttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any], jax.Array]


def sequence_forward(params: Params, cfg: ModelConfig, tokens: jax.Array, attend_sequence: SequenceAttendFn,
                     remat: bool = True) -> jax.Array:
    """The last hidden states [B, T, D] of `tokens` [B, T] from position 0: `forward`'s layers with
    attention over the whole sequence's keys and values instead of a KV cache, for training (the NSA
    gate fit), where `attend_sequence` is a differentiable attention. Each layer writes its keys and
    values into a one-layer cache of T slots, which `attend_sequence` reads whole and the next layer
    overwrites, so no [L, ...] cache is kept; with `remat` each layer is recomputed in the backward
    pass, so a row's memory does not grow with the number of layers. Reference kernels."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    one_layer = init_cache(dataclasses.replace(cfg, num_layers=1), B, T)

    def attend(layer, q, cache, _lx, gates, carry):
        whole = lambda c: jnp.swapaxes(c[:, :, :T], 1, 2)  # [B, T, Hkv, Dh]
        k, v = cache.view(layer)
        return attend_sequence(q, whole(k), whole(v), gates), None, carry

    num_entries = params["layers"]["attn_norm"].shape[0]
    hidden, _, _ = forward(params, cfg, tokens, positions, jnp.ones((B, T), bool), one_layer, attend,
                           layer_ids=np.zeros(num_entries, np.int32), remat=remat)
    return hidden


def attention(cfg: ModelConfig, q_slot: jax.Array, backend: str, collect=None, tree=None,
              verification: nsa.Verification | None = None, lo: jax.Array | None = None) -> AttendFn:
    """The model's own attention for query rows at slots `q_slot` [B, T]: full causal attention over
    the cache (a draft tree's rows see only their ancestors among its slots: `tree`, a
    kernels.TreeMask; `lo` [B, T]: no slot below, a sliding window on every layer), or NSA for NSA
    models (`verification`: how a target pass verifies draft rows; its carry is `attention_carry`'s).
    Per layer it yields the selection scores asked for by `collect` (None without it), averaged over
    all query heads under tensor parallelism."""
    if cfg.nsa:
        attend = nsa.attend_fn(cfg, q_slot, backend, collect, tree, verification)
    else:
        def attend(layer, q, cache, _, gates, carry):
            window = sink_window(gates) | ({} if lo is None else {"lo": lo})
            out, _, scores = kernels.verify_attention(
                q, cache.k, cache.v, cache.pages, layer, q_slot, page_size=cache.page_size, scale=cfg.head_dim**-0.5,
                collect=collect, tree=tree, backend=backend, **window
            )
            return out, scores, carry

    if cfg.tp == 1 or collect is None:
        return attend

    def all_heads(layer, q, cache, lx, gates, carry):  # tensor parallel: scores over every device's heads
        out, scores, carry = attend(layer, q, cache, lx, gates, carry)
        return out, sharding.mean_over_shards(scores, cfg), carry

    return all_heads


def attention_carry(cfg: ModelConfig, q_slot: jax.Array, num_slots: int, verification: nsa.Verification | None):
    """The initial layer-to-layer carry of `attention(cfg, q_slot, ..., verification=verification)`."""
    reuse = cfg.nsa is not None and verification is not None and verification.reuse
    return nsa.initial_carry(cfg, q_slot, num_slots, reuse)


def score(params: Params, cfg: ModelConfig, tokens: jax.Array, backend: str = "reference",
          layer_ids: np.ndarray | jax.Array | None = None,
          capture: tuple[int, ...] = ()) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Teacher-forced float32 logits [B, T, V] of a full forward over `tokens` [B, T] from position 0
    (of the model whose layer stack is `layer_ids`' layers: see `forward`); with `capture`, (logits,
    the features of those layers [B, T, len(capture) * D]: `forward`'s)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = init_cache(cfg, B, T)
    hidden, _, _, *features = forward(params, cfg, tokens, positions, jnp.ones((B, T), bool), cache,
                                      attention(cfg, positions, backend), layer_ids=layer_ids, backend=backend,
                                      capture=capture)
    out = logits(params, cfg, hidden)
    return (out, features[0]) if capture else out
