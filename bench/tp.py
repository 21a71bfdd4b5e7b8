"""Tensor parallelism: plain and vegas step times at TP 1 against TP N, the all-reduce, the floor.

    PYTHONPATH=. python3 bench/tp.py [--tp 2] [--models qwen3-8b,qwen3-32b,qwen3-30b-a3b,gpt-oss-20b]
        [--splits columns,experts] [--batch 4] [--context 131072] [--tiny] [--out DIR]

Runs on one host's GPUs (nvidia-h200-x2 for --tp 2). Per model and TP (1 and N; TP 1 is skipped where
the weights and cache do not fit one device): random bf16 weights generated on each device's shard
and a random KV cache split by KV heads (no device ever holds a full copy), then the engine's plain
decode loop (ms per step) and vegas g6 r0.07 (ms per iteration), each the median of 3 calls of STEPS
iterations; TP N runs every program under `models.sharding.Parallel`, as `--tp` does (`--tp 1`: that
path on one device, against plain jit: Pallas kernels under shard_map on one GPU). The
all-reduce: a psum of one step's hidden rows [B, D] (float32, as the decoder sums) between the
devices, per call. Floors per device: a plain step's `common.step_floor_s` (weights, the KV it
reads and the logits over the measured copy bandwidth) and a vegas iteration's (`common.floors`: 6
drafts over 7% of the context plus the verify pass) over N, plus 2 x layers all-reduces per forward
(7 forwards a vegas iteration). JAX may take 95% of each GPU (Qwen3-32B at TP 2 holds 101 GB per
device; JAX's default is 75%). Greedy tokens of a few steps are compared
across TPs (random bf16 weights: near-ties may flip; the CPU tests hold exact equality in float32).
MoE models (bf16 experts) run at TP N once per `--splits`: every expert's columns split (the default
where it works) and whole experts split (`ModelConfig.expert_parallel`), the comparison the two
layouts need. Writes DIR/tp.json; prints a table last. `--tiny`: a small dense and a small MoE model
on whatever devices there are (CPU with XLA_FLAGS=--xla_force_host_platform_device_count=2), to check
the script.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # Qwen3-32B at TP 2: 101 GB per device

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from bench import common  # noqa: E402
from jaxspec.decoding import engine  # noqa: E402
from jaxspec.decoding.sampling import SamplingConfig  # noqa: E402
from jaxspec.decoding.spec import SpecConfig, spec_from_settings  # noqa: E402
from jaxspec.decoding.tree import MAX_TREE_ROWS  # noqa: E402
from jaxspec.models import decoder, sharding  # noqa: E402
from jaxspec.models.config import ModelConfig, MoEConfig, RopeConfig  # noqa: E402
from jaxspec.models.kvcache import KVCache, cache_bytes, cache_slots  # noqa: E402

STEPS = 8  # decode iterations per timed call
QWEN3_32B = ModelConfig(  # Qwen3-32B's shapes: 65 GB of bf16 weights
    model_type="qwen3", vocab_size=151936, hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8,
    head_dim=128, intermediate_size=25600, qk_norm=True, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
    max_position_embeddings=40960, dtype="bfloat16",
)
TINY = ModelConfig(model_type="qwen3", vocab_size=1024, hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                   head_dim=32, intermediate_size=256, qk_norm=True, dtype="bfloat16", max_position_embeddings=4096)
TINY_MOE = TINY.replace(model_type="qwen3_moe", moe=MoEConfig(8, 2, 64))
MODELS = {"qwen3-8b": common.QWEN3_8B, "qwen3-32b": QWEN3_32B, "qwen3-30b-a3b": common.QWEN3_30B_A3B,
          "gpt-oss-20b": common.GPT_OSS_20B}
GREEDY = SamplingConfig()


def programs(cfg: ModelConfig, spec: SpecConfig, max_len: int, mesh):
    """(start, decode) of the engine for `spec`: jitted on one device (mesh None) or tensor-parallel."""
    def start(c):
        eng = engine.Engine(c, spec.compiled(max_len), GREEDY, max_len)
        return lambda p, cache, ids, n, key, budget, new, stop: eng.start(
            p, cache, ids, n, key, budget, max_new_tokens=new, stop_ids=stop)

    def decode(c):
        eng = engine.Engine(c, spec.compiled(max_len), GREEDY, max_len)
        return lambda p, state, iterations: eng.decode(p, state, max_iterations=iterations)

    if mesh is None:
        return jax.jit(start(cfg), donate_argnums=1), jax.jit(decode(cfg), donate_argnums=1)
    return sharding.Parallel(start, cfg, mesh, (1,)), sharding.Parallel(decode, cfg, mesh, (1,))


def random_model(cfg: ModelConfig, batch: int, num_slots: int, mesh):
    """Random params and KV cache, each leaf generated where it lives (split over `mesh` if given; the
    same values on any mesh)."""
    params_shape = jax.eval_shape(lambda k: decoder.init_params(cfg, k), jax.random.key(0))
    cache_shape = jax.eval_shape(lambda k: common.random_cache(cfg, batch, num_slots, k), jax.random.key(1))
    if mesh is None:
        return decoder.init_params(cfg, jax.random.key(0)), common.random_cache(cfg, batch, num_slots, jax.random.key(1))
    named = lambda spec: NamedSharding(mesh, spec)
    params_sharding = jax.tree.map(named, sharding.param_specs(params_shape, cfg.expert_parallel),
                                   is_leaf=lambda x: isinstance(x, P))
    heads, table = named(P(None, sharding.AXIS, None, None)), named(P())  # pools by KV heads; the page table whole
    cache_sharding = jax.tree.map(lambda x: heads if x.ndim == 4 else table, cache_shape)
    params = jax.jit(lambda k: decoder.init_params(cfg, k), out_shardings=params_sharding)(jax.random.key(0))
    params = sharding.shard_params(params, cfg, mesh)  # the same model as on one device: its TP layout
    cache = jax.jit(lambda k: common.random_cache(cfg, batch, num_slots, k), out_shardings=cache_sharding)(jax.random.key(1))
    return params, cache


def time_method(cfg, spec: SpecConfig, params, cache: KVCache, batch: int, context: int, max_len: int, mesh):
    """(ms per iteration, the greedy tokens of the first call, the cache back)."""
    start, decode = programs(cfg, spec, max_len, mesh)
    ids, lengths = common.random_prompts(cfg, batch, context)
    state = start(params, cache, jnp.asarray(ids), jnp.asarray(lengths), jax.random.key(0), spec.budget(),
                  jnp.int32(max_len - context), jnp.asarray([-1], jnp.int32))
    state = jax.block_until_ready(decode(params, state, jnp.int32(STEPS)))  # compile + warm up
    first = np.asarray(state.tokens)[:, context : context + STEPS].tolist()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        state = jax.block_until_ready(decode(params, state, jnp.int32(STEPS)))
        times.append((time.perf_counter() - t) / STEPS)
    return 1e3 * float(np.median(times)), first, state.cache


def all_reduce_us(mesh, batch: int, hidden: int, repeats: int = 200) -> float:
    """One psum of [batch, hidden] float32 over `mesh`, in microseconds (median of 3 loops)."""
    body = lambda x: jax.lax.fori_loop(0, repeats, lambda i, x: jax.lax.psum(x, sharding.AXIS) * 0.5, x)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    x = jnp.ones((batch, hidden), jnp.float32)
    jax.block_until_ready(f(x))
    return 1e6 * common.seconds_per_call(f, x) / repeats


def fits(cfg: ModelConfig, batch: int, num_slots: int, tp: int) -> bool:
    weights = common.tree_bytes(jax.eval_shape(lambda k: decoder.init_params(cfg, k), jax.random.key(0)))
    memory = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    return memory is None or (weights + cache_bytes(cfg, batch, num_slots)) / tp < 0.85 * memory


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--models", default="qwen3-8b,qwen3-32b")
    p.add_argument("--splits", default="columns", help="MoE models at TP N: columns,experts (each a run)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    rates = common.measure_rates(tiny=args.tiny)
    models = {"tiny": TINY, "tiny-moe": TINY_MOE} if args.tiny else {name: MODELS[name] for name in args.models.split(",")}
    context = 1024 if args.tiny else args.context
    max_len = context + (MAX_TREE_ROWS + 1) * (4 * STEPS + 2)
    backend = "pallas" if jax.default_backend() == "gpu" else "reference"
    mesh_n = sharding.make_mesh(args.tp)
    rows = []
    for name, cfg in models.items():
        sharding.check(cfg, args.tp)
        num_slots = cache_slots(max_len + MAX_TREE_ROWS)
        reduce_us = all_reduce_us(mesh_n, args.batch, cfg.hidden_size)
        tokens = {}
        splits = args.splits.split(",") if cfg.moe is not None else ["columns"]
        # --tp 1: the shard_map path on one device against jit
        for tp, mesh, split in [(1, None, "-")] + [(args.tp, mesh_n, split) for split in splits]:
            cfg = cfg.replace(expert_parallel=split == "experts")
            if not fits(cfg, args.batch, num_slots, tp):
                rows.append({"model": name, "tp": tp, "split": split, "fits": False})
                continue
            params, cache = random_model(cfg, args.batch, num_slots, mesh)
            row = {"model": name, "tp": tp, "split": split, "shard_map": mesh is not None, "fits": True,
                   "batch": args.batch, "context": context}
            reduces_ms = 2 * cfg.num_layers * reduce_us / 1e3 if tp > 1 else 0.0  # per forward
            for method in ("plain", "vegas"):
                spec = spec_from_settings(method, gamma=6, ratio=0.07, backend=backend)
                floor = common.floors(cfg, common.tree_bytes(params), spec, args.batch, context, rates)
                forwards = 1 if method == "plain" else spec.shape.depth + 1
                row[f"{method}_floor_ms"] = 1e3 * floor["plain_floor_s" if method == "plain" else "iteration_floor_s"] / tp + forwards * reduces_ms
                ms, first, cache = time_method(cfg, spec, params, cache, args.batch, context, max_len, mesh)
                row[f"{method}_ms"] = ms
                row[f"{method}_x_floor"] = ms / row[f"{method}_floor_ms"]
                tokens[(method, split)] = first
            row["all_reduce_us"] = reduce_us if tp > 1 else None
            for method in ("plain", "vegas"):  # against TP 1's tokens
                if split != "-" and (method, "-") in tokens and (method, split) in tokens:
                    a, b = np.asarray(tokens[(method, "-")]), np.asarray(tokens[(method, split)])
                    row[f"{method}_tokens_equal_share"] = float((a == b).mean())
            rows.append(row)
            del params, cache
    result = {**common.run_info(), "command": "bench/tp.py", "args": vars(args) | {"out": str(args.out)},
              "rates": rates, "rows": rows}
    common.write_json(args.out / "tp.json", result)
    columns = [("model", "model", ""), ("TP", "tp", ""), ("split", "split", ""), ("shard_map", "shard_map", ""),
               ("fits", "fits", ""), ("plain ms/step", "plain_ms", ".2f"),
               ("floor ms", "plain_floor_ms", ".2f"), ("x floor", "plain_x_floor", ".2f"),
               ("vegas ms/iteration", "vegas_ms", ".2f"), ("floor ms", "vegas_floor_ms", ".2f"),
               ("x floor", "vegas_x_floor", ".2f"), ("all-reduce us", "all_reduce_us", ".1f")]
    print(common.markdown_table(rows, columns))


if __name__ == "__main__":
    main()
