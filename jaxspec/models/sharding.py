"""Tensor parallelism (Megatron style) with JAX's own machinery: a one-axis `Mesh` ("tp"),
`NamedSharding`s and `shard_map`.

Layout. The decoder's matrices are split so that a layer needs two all-reduces: q/k/v (and NSA's gate
columns) and gate/up by output columns, o and down by input rows; the KV cache, and any selection
state with a KV-head axis, by KV heads; the embeddings and the LM head by vocabulary. The fused
matrices are stored in the *TP layout*: their columns reordered so that shard s's block is
[q_s | k_s | v_s | gates_s] (gate_up: [gate_s | up_s]), so each device sees an ordinary fused matrix
of its own heads. Query head h uses KV head h // G, and shard s holds query heads [s Hq/tp, ...) and
KV heads [s Hkv/tp, ...), so grouped attention needs nothing from other devices (gpt-oss's sinks
[L, Hq] split with them). norms are replicated. Mixture-of-experts models split every expert's
columns as the dense MLP's (`jaxspec.models.moe`): moe_gate_up and its bias in the TP layout
[gate_s | up_s] of each expert, moe_down by rows (packed MXFP4 stacks too, their bytes and scales
alike); the router is replicated, so every device routes identically. Where packed experts' columns
cannot split into whole scale groups (gpt-oss-20b at --tp 4), whole experts split instead
(`splits_experts`, `ModelConfig.expert_parallel`): the expert stacks by their expert axis, each device
computing its own experts' share of every row, summed by the same all-reduce. A bias added after a
row-split product is replicated and counted once: gpt-oss's o bias goes into the replicated stream
before the all-reduce's residual add, the experts' down bias into shard 0's share of the sum
(`first_shard_only`).

Execution. A program (`Parallel`) runs under `shard_map`, each device on one shard's view of the
model (`local_config`: its heads and MLP or expert columns; the vocabulary keeps the model's size).
Everything that is not split (tokens, lengths, keys, sampling, acceptance, the drafters' bookkeeping)
is computed identically on every device. The decoder calls the collectives below in four places (and
an MoE layer `first_shard_only` on its down bias):
`embed` (each device looks up its vocabulary rows, then a sum), `all_reduce` after o and after down,
`gather_vocab` on the logits, and `mean_over_shards` on the selection scores collected in a
verification (vegas averages its scores over all query heads: one reduction per layer, so every
device selects the same slots; Quest's and NSA's selections are per KV head and stay local).

Weights go straight into their shards: `shard_params` places host arrays by their spec (each device
receives its block only) and reorders the fused columns on the devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.errors import JaxspecError
from jaxspec.models.config import ModelConfig
from jaxspec.models.quantize import Quantized
from pallas_kernels.mxfp4 import MXFP4, MXFP4_GROUP, has_packed

AXIS = "tp"
# split along the last axis (sinks [L, Hq]: by query head, each shard's heads in order)
COLUMNS = ("wqkv", "bqkv", "w_gate_up", "moe_gate_up", "moe_gate_up_bias", "sinks", "lm_head", "draft_head")
ROWS = ("wo", "w_down", "moe_down", "embed")  # split along the second-to-last axis (embed's rows: the vocabulary)
EXPERTS = ("moe_gate_up", "moe_down", "moe_gate_up_bias", "moe_down_bias")  # [L, E, ...]: expert parallelism splits E


# --- configuration ------------------------------------------------------------------------------------

def check(cfg: ModelConfig, tp: int) -> None:
    """One-line errors for a `--tp` that does not divide the model."""
    mlp = (("MLP columns", cfg.intermediate_size) if cfg.moe is None else ("experts", cfg.moe.num_experts)
           if cfg.expert_parallel else ("expert columns", cfg.moe.expert_size))
    counts = (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads), mlp,
              ("vocabulary entries", cfg.vocab_size))
    for name, n in counts:
        if n % tp:
            raise JaxspecError(f"--tp {tp} does not divide the model's {n} {name}")


def make_mesh(tp: int) -> Mesh:
    """The first `tp` devices as a one-axis mesh (one-line errors for a `--tp` this machine cannot run)."""
    if tp < 1:
        raise JaxspecError(f"--tp must be at least 1, got {tp}")
    if tp > len(jax.devices()):
        raise JaxspecError(f"--tp {tp} needs {tp} devices; this machine has {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:tp]), (AXIS,))


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """One shard's view of the model: its query heads, KV heads and MLP (or every expert's) columns
    (`cfg.tp` = tp); under expert parallelism whole experts (the router still routes to all of them)."""
    mlp = (dict(intermediate_size=cfg.intermediate_size // tp) if cfg.moe is None else {} if cfg.expert_parallel
           else dict(moe=dataclasses.replace(cfg.moe, expert_size=cfg.moe.expert_size // tp)))
    return cfg.replace(num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp, tp=tp, **mlp)


def splits_experts(cfg: ModelConfig, packed: bool, tp: int) -> bool:
    """Whether `tp` devices split whole experts rather than every expert's columns: only where the
    columns cannot split, i.e. MXFP4 experts whose down rows a device would hold are not whole
    32-value scale groups (gpt-oss-20b's 2880 columns at --tp 4). Column splits read 1/tp of each
    routed expert on every device, an even load at any row count."""
    return cfg.moe is not None and tp > 1 and packed and (cfg.moe.expert_size // tp) % MXFP4_GROUP != 0


# --- collectives the decoder calls (no-ops without tensor parallelism) --------------------------------

def embed(table: jax.Array, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Embedding rows of `tokens`; split by vocabulary, each device adds the rows it holds (others 0)."""
    if cfg.tp == 1:
        return jnp.take(table, tokens, axis=0)
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(AXIS) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)
    return jax.lax.psum(x, AXIS)


def all_reduce(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The sum over shards of a row-split product's partial results (summed in float32)."""
    if cfg.tp == 1:
        return x
    return jax.lax.psum(x.astype(jnp.float32), AXIS).astype(x.dtype)


def gather_vocab(logits: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[..., V / tp] logits of each shard's vocabulary -> [..., V] on every device."""
    if cfg.tp == 1:
        return logits
    return jax.lax.all_gather(logits, AXIS, axis=logits.ndim - 1, tiled=True)


def mean_over_shards(scores: Any, cfg: ModelConfig) -> Any:
    """Scores averaged over each shard's query heads -> averaged over all heads (equal head counts)."""
    if cfg.tp == 1 or scores is None:
        return scores
    return jax.lax.pmean(scores, AXIS)


def local_experts(expert_ids: jax.Array, experts: int, cfg: ModelConfig) -> jax.Array:
    """Router ids [N, k] of all experts -> ids among this device's `experts` (whole experts split in
    order), -1 for another device's (the experts kernel drops those assignments)."""
    if cfg.tp == 1 or not cfg.expert_parallel:
        return expert_ids
    local = expert_ids - jax.lax.axis_index(AXIS) * experts
    return jnp.where((local >= 0) & (local < experts), local, -1)


def first_shard_only(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x on shard 0, zeros on the others: a replicated term that a later `all_reduce` counts once."""
    if cfg.tp == 1:
        return x
    return jnp.where(jax.lax.axis_index(AXIS) == 0, x, jnp.zeros_like(x))


# --- parameters ---------------------------------------------------------------------------------------

def _split(ndim: int, from_end: int) -> P:
    return P(*(AXIS if a == ndim - from_end else None for a in range(ndim)))


def param_specs(params: dict, experts: bool = False) -> dict:
    """The PartitionSpec of every params leaf (quantized draft copies included: an int8 matrix's
    per-column scales follow its columns; int4's group scales follow its rows too). An MXFP4 expert
    stack stores W's columns as its rows ([..., N, K/2] bytes, [..., N, K/32] scales): split by
    columns, its second-to-last axis; by rows, its last (whole scale groups: `check_packed`).
    `experts` (`ModelConfig.expert_parallel`): the EXPERTS stacks split by their expert axis instead."""

    def spec(path, x):
        name = path[-1].key
        if path[0].key == "eagle":  # an EAGLE-3 head runs whole on every device
            return P()
        if experts and name in EXPERTS:
            return jax.tree.map(lambda a: P(None, AXIS), x)
        if name not in COLUMNS + ROWS:
            return P()
        from_end = 1 if name in COLUMNS else 2
        if isinstance(x, MXFP4):
            return dataclasses.replace(x, blocks=_split(x.blocks.ndim, 3 - from_end),
                                       scales=_split(x.scales.ndim, 3 - from_end))
        if not isinstance(x, Quantized):
            return _split(x.ndim, from_end)
        scale_split = from_end == 1 or x.bits == 4
        return Quantized(_split(x.values.ndim, from_end), _split(x.scale.ndim, from_end) if scale_split else P(),
                         None, x.backend)

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, (Quantized, MXFP4)))


def _column_order(cfg: ModelConfig, tp: int) -> dict[str, np.ndarray]:
    """The TP layout's column order of the fused matrices (indices into the standard layout); whole
    experts keep theirs."""
    Hq, Hkv, Dh, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q, kv = Hq * Dh, Hkv * Dh
    parts = [(0, q), (q, kv), (q + kv, kv)] + ([(q + 2 * kv, 3 * Hq)] if cfg.nsa else [])
    shard = lambda s, parts: np.concatenate([start + s * (n // tp) + np.arange(n // tp) for start, n in parts])
    qkv = np.concatenate([shard(s, parts) for s in range(tp)])
    gate_up = lambda F: np.concatenate([shard(s, [(0, F), (F, F)]) for s in range(tp)])
    if cfg.moe is None:
        return {"wqkv": qkv, "bqkv": qkv, "w_gate_up": gate_up(F)}
    if cfg.expert_parallel:
        return {"wqkv": qkv, "bqkv": qkv}
    experts = gate_up(cfg.moe.expert_size)  # every expert's [gate_s | up_s], and its bias's
    return {"wqkv": qkv, "bqkv": qkv, "moe_gate_up": experts, "moe_gate_up_bias": experts}


def check_packed(params: dict, cfg: ModelConfig, tp: int) -> None:
    """A one-line error when MXFP4 experts cannot be split `tp` ways: each device's rows of the down
    matrix must be whole 32-value scale groups (gpt-oss-20b's 2880 columns: tp 2, not 4)."""
    if not cfg.expert_parallel and splits_experts(cfg, has_packed(params), tp):
        raise JaxspecError(f"--tp {tp}: MXFP4 experts split by {MXFP4_GROUP}-value scale groups, and "
                           f"{cfg.moe.expert_size} expert columns give {cfg.moe.expert_size // tp} a device "
                           "(a --tp that leaves a multiple of 32, or the checkpoint's unquantized form)")


def place(params: dict, mesh: Mesh, experts: bool = False) -> dict:
    """`params` (host or device arrays) split over `mesh` by `param_specs`."""
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, experts),
                             is_leaf=lambda x: isinstance(x, P))
    return jax.device_put(params, shardings)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Standard-layout params (`decoder.param_shapes`, exact weights) -> TP-layout params split over
    `mesh`. Host arrays go to their devices block by block (no device holds a full copy); the fused
    matrices' columns are then reordered on the devices, one stacked matrix at a time. The draft's
    copies (`draft_weights.with_draft_weights`) are made from the result, then `place`d."""
    check_packed(params, cfg, mesh.size)
    placed = place(params, mesh, cfg.expert_parallel)
    layers = dict(placed["layers"])
    for name, columns in _column_order(cfg, mesh.size).items():
        if name in layers:
            w, before = layers[name], params["layers"][name]
            # a copy place made is reordered in place
            fresh = all(a is not b for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(before)))
            axis = -2 if isinstance(w, MXFP4) else -1  # an MXFP4 stack's rows are W's columns
            reorder = jax.jit(lambda w: jax.tree.map(lambda a: jnp.take(a, columns, axis=axis), w),
                              out_shardings=jax.tree.map(lambda a: a.sharding, w), donate_argnums=0 if fresh else ())
            layers[name] = reorder(w)
    return {**placed, "layers": layers}


# --- programs -----------------------------------------------------------------------------------------

def spec_of(x: Any, mesh: Mesh) -> P:
    """How an argument is split: its own sharding when it is an array split over `mesh`, else replicated."""
    where = getattr(x, "sharding", None)
    if isinstance(where, NamedSharding) and where.mesh == mesh:
        return where.spec
    return P()


def _difference_spec(full: jax.ShapeDtypeStruct, local: jax.ShapeDtypeStruct, tp: int) -> P:
    """The spec of an output from its shape on the whole model and on one shard: the axis that shrank."""
    axes = [a for a, (f, l) in enumerate(zip(full.shape, local.shape)) if f != l]
    if len(axes) > 1 or any(full.shape[a] != tp * local.shape[a] for a in axes):
        raise ValueError(f"cannot tell how an output of shape {full.shape} is split from its shard's {local.shape}")
    return P(*(AXIS if a in axes else None for a in range(len(full.shape))))


class Parallel:
    """`jax.jit(make(cfg))`, run tensor-parallel over `mesh`: `make(local_config(cfg, tp))` per device
    under `shard_map`. An argument is split as its own sharding says (`spec_of`); an output as the
    difference between its shape from `make(cfg)` on the whole model and from the shard's function
    (traced with `eval_shape` once per argument signature), so KV caches and drafter states with a
    KV-head axis come out split and everything else replicated. shard_map's replication check is
    off: caches made inside a program start replicated and become split as they are written, which
    its type check would need marked by hand (the tests compare every method with one device).
    Empty arrays (plain decoding's acceptance by depth) carry no data and are made inside instead of
    passed in: XLA's CPU backend crashes on empty shard_map arguments. Has `lower` like `jax.jit`."""

    def __init__(self, make: Callable[[ModelConfig], Callable], cfg: ModelConfig, mesh: Mesh,
                 donate_argnums: tuple[int, ...] = ()):
        self.mesh, self.tp, self.donate_argnums = mesh, mesh.size, donate_argnums
        self.full, self.local = make(cfg), make(local_config(cfg, mesh.size))
        self._jitted: dict = {}

    def _program(self, args: tuple) -> tuple[Callable, tuple[int, ...]]:
        """The jitted program for arguments like `args`, and which argument leaves it takes."""
        leaves, treedef = jax.tree.flatten(args)
        owner = [a for a, arg in enumerate(args) for _ in jax.tree.leaves(arg)]  # each leaf's argument
        structs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype)
                   for x in leaves]
        specs = [spec_of(x, self.mesh) for x in leaves]
        kept = tuple(i for i, st in enumerate(structs) if 0 not in st.shape)
        signature = (treedef, tuple(zip(structs, specs)))
        if signature not in self._jitted:

            def shard(*kept_leaves):
                given = dict(zip(kept, kept_leaves))
                full = [given[i] if i in given else jnp.zeros(st.shape, st.dtype) for i, st in enumerate(structs)]
                return self.local(*jax.tree.unflatten(treedef, full))

            in_specs = tuple(specs[i] for i in kept)
            full_out = jax.eval_shape(self.full, *args)
            # each output's shard shape: the shard's function with every output taken as replicated
            as_replicated = jax.shard_map(shard, mesh=self.mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
            local_out = jax.eval_shape(as_replicated, *(structs[i] for i in kept))
            out_specs = jax.tree.map(lambda f, l: _difference_spec(f, l, self.tp), full_out, local_out)
            mapped = jax.shard_map(shard, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
            donate = tuple(n for n, i in enumerate(kept) if owner[i] in self.donate_argnums)
            self._jitted[signature] = jax.jit(mapped, donate_argnums=donate)
        return self._jitted[signature], kept

    def lower(self, *args) -> _Lowered:
        program, kept = self._program(args)
        return _Lowered(program.lower(*_taken(args, kept)), kept)

    def __call__(self, *args):
        program, kept = self._program(args)
        return program(*_taken(args, kept))


def _taken(args: tuple, kept: tuple[int, ...]) -> list:
    leaves = jax.tree.leaves(args)
    return [leaves[i] for i in kept]


@dataclasses.dataclass(frozen=True)
class _Lowered:
    lowered: Any
    kept: tuple[int, ...]

    def compile(self) -> _Compiled:
        return _Compiled(self.lowered.compile(), self.kept)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A compiled `Parallel` program, called with the full arguments as a jitted one is."""

    compiled: Any
    kept: tuple[int, ...]

    @property
    def out_info(self):
        return self.compiled.out_info

    def __call__(self, *args):
        return self.compiled(*_taken(args, self.kept))
