"""Shared benchmark plumbing: device rates, timing, synthetic long-context states, floors, result files.

Benchmarks run on the GPU machine as `PYTHONPATH=. python3 bench/<name>.py`; each measures the copy
bandwidth and the bf16 matmul rate in the same run and states times against them (docs/development.md,
"Measurement protocol").
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import math
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import eagle
from jaxspec.models.config import ModelConfig, MoEConfig, RopeConfig
from jaxspec.decoding.engine import DecodeState
# The step floor (bytes over bandwidth) is the planner's cost-model base; benchmarks use the same one.
from jaxspec.planner.cost import kv_bytes_read, layer_attention_bytes, seconds_per_call, step_floor_s, tree_bytes  # noqa: F401
from jaxspec.models.kvcache import KVCache, cache_slots, pool_shape
from jaxspec.decoding.tree import MAX_TREE_ROWS
from jaxspec import corpus, files
from jaxspec.runner import decode_fns, encode_prompts, prefill_fn
from jaxspec.training import eagle as eagle_training
from jaxspec.training.data import split_documents
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.xla_flags import set_gpu_flags
from pallas_kernels import paging
from pallas_kernels.mxfp4 import MXFP4, pack_scales, pack_words

# Benchmarks are entry points: they run with the XLA GPU flags that `python -m jaxspec.generate` sets,
# set here before any of them computes anything.
set_gpu_flags()

RESULTS = Path(__file__).parent / "results"

QWEN3_8B = ModelConfig(
    model_type="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
    max_position_embeddings=40960, qk_norm=True, dtype="bfloat16",
)

# Qwen3-30B-A3B's shapes: 48 layers of Qwen3 attention, each MLP 128 experts of 768 columns, 8 routed a token
QWEN3_30B_A3B = ModelConfig(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
    head_dim=128, intermediate_size=6144, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
    max_position_embeddings=40960, qk_norm=True, dtype="bfloat16",
    moe=MoEConfig(num_experts=128, top_k=8, expert_size=768, norm_topk_prob=True),
)

# gpt-oss-20b's shapes: 24 layers alternating sliding-window (128 keys, from the first) and full attention
# with sinks and biases, 64 query / 8 KV heads of 64, each MLP 32 experts of 2,880 columns, 4 routed a
# token (bf16 here; the released form's packed MXFP4 experts: `random_mxfp4`, profile_step.py --experts mxfp4)
GPT_OSS_20B = ModelConfig(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64, num_kv_heads=8,
    head_dim=64, intermediate_size=2880, rms_norm_eps=1e-5, max_position_embeddings=131072, qkv_bias=True,
    o_bias=True, sinks=True, sliding_window=128, sliding_layers=tuple(range(0, 24, 2)), dtype="bfloat16",
    rope=RopeConfig(theta=150000.0, kind="yarn", factor=32.0, original_max_position=4096, truncate=False),
    moe=MoEConfig(num_experts=32, top_k=4, expert_size=2880, router="topk_softmax", norm_topk_prob=False,
                  activation="gpt_oss", bias=True),
)

# A 1.2B Llama shape (Llama-3.2-1B-like, 2 KV heads as NSA-1B): small enough to be launch-bound at batch 1
LLAMA_1B = ModelConfig(
    model_type="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=2,
    head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
    max_position_embeddings=262144, tie_word_embeddings=True, dtype="bfloat16",
)

# SmolLM2-135M's shapes (random weights: timing only; the real model is jaxspec.loaders.smollm2_path())
SMOLLM2 = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    intermediate_size=1536, rms_norm_eps=1e-5, rope=RopeConfig(theta=1e5), max_position_embeddings=8192,
    tie_word_embeddings=True, dtype="bfloat16",
)


def measure_rates(tiny: bool = False) -> dict:
    """Copy bandwidth, the best of three large copies (bf16 x*2, memcpy, f32 x+1; bytes read plus
    written), and the bf16 matmul rate (8192^3), on random data."""
    n = 1 << (20 if tiny else 29)  # bf16 elements: 1 GiB on a GPU, well past L2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    x32 = jax.random.normal(jax.random.key(1), (n // 2,), jnp.float32)
    copies = {"bf16 x*2": (lambda x: x * 2, x), "memcpy": (jnp.copy, x), "f32 x+1": (lambda x: x + 1, x32)}
    by_method = {name: 2 * arg.nbytes / seconds_per_call(jax.jit(f), arg) / 1e9 for name, (f, arg) in copies.items()}
    m = 512 if tiny else 8192
    a, b = (jax.random.normal(jax.random.key(i), (m, m), jnp.bfloat16) for i in (2, 3))
    mm = seconds_per_call(jax.jit(lambda a, b: a @ b), a, b)
    rates = {"copy_GBps": max(by_method.values()), "copy_GBps_by_method": by_method, "matmul_TFLOPs": 2 * m**3 / mm / 1e12}
    print(f"copy bandwidth {rates['copy_GBps']:.0f} GB/s (read + write), bf16 matmul {rates['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    return rates


def run_info() -> dict:
    return {
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python3"] + sys.argv),
    }


def write_json(path: Path, result: dict) -> None:
    """Atomically (benchmarks rewrite their JSON after every item: a cut-off run leaves a whole file)."""
    files.write_text(path, json.dumps(result, indent=1, default=float))


def floors(cfg, weight_bytes: int, spec: SpecConfig, batch: int, context: int, rates: dict,
           draft_bytes: int | None = None) -> dict:
    """Bytes floors (seconds) of a plain step, one draft forward (reading `draft_bytes` of weights;
    over the whole context for `full`; the weights' by default) and the verify pass at `context`."""
    bw = rates["copy_GBps"]
    plain = step_floor_s(cfg, weight_bytes, batch, context, bw)
    if spec.method == "plain":
        return {"plain_floor_s": plain}
    rows = spec.shape.rows
    logits = (rows - 1) * batch * cfg.vocab_size * 4 / (bw * 1e9)
    if spec.method == "eagle":  # the head's weights (`draft_bytes`) and its one layer's KV of the whole context
        head_kv = 2 * batch * context * spec.eagle.num_kv_heads * spec.eagle.head_dim * jnp.dtype(cfg.dtype).itemsize
        draft = (draft_bytes + head_kv) / (bw * 1e9)
    elif spec.method == "ngram":
        draft = 0.0
    else:
        selected = context if spec.method == "full" else max(spec.min_tokens, int(spec.ratio * context)) + spec.shape.depth + rows
        draft = step_floor_s(cfg, weight_bytes if draft_bytes is None else draft_bytes, batch, selected, bw)
    return {"plain_floor_s": plain, "draft_floor_s": draft, "verify_floor_s": plain + logits,
            "iteration_floor_s": spec.shape.depth * draft + plain + logits}


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_layers(key, shape, dtype):
    """Standard-normal [L, ...] filled one layer at a time (no full-size float32 temporary)."""
    def body(layer, x):
        return x.at[layer].set(jax.random.normal(jax.random.fold_in(key, layer), shape[1:], dtype))
    return jax.lax.fori_loop(0, shape[0], body, jnp.zeros(shape, dtype))


def page_table(batch: int, num_slots: int, page_size: int = paging.DEFAULT_PAGE_SIZE, scattered: bool = True,
               seed: int = 0) -> jax.Array:
    """[batch, num_slots / page_size] int32: the table of a pool of batch * num_slots slots and the null
    page; rows' pages in random order over the pool (a server's, after admissions and evictions), or
    consecutive (`paging.contiguous_pages`: a batch's own cache)."""
    R = num_slots // page_size
    if not scattered:
        return paging.contiguous_pages(batch, R)
    order = 1 + np.random.default_rng(seed).permutation(batch * R)
    return jnp.asarray(order.reshape(batch, R), jnp.int32)


EXPERT_FORMS = ("bf16", "mxfp4", "mxfp4-words", "mxfp4-scale-words")
EXPERT_FORMS_HELP = ("an MoE model's expert stacks: the config's dtype, or packed MXFP4 of random codes (gpt-oss's "
                     "released form; mxfp4-words: as mxfp4.to_words words; mxfp4-scale-words: words with their "
                     "scales four to a word, mxfp4.pack_scales)")


def with_mxfp4_experts(params, form: str) -> dict:
    """params with an MoE model's expert stacks replaced by random MXFP4 ones in `form` (of EXPERT_FORMS,
    decoded in the experts kernel), each bf16 stack freed before its packed one is drawn."""
    layers = params["layers"]
    for i, name in enumerate(("moe_gate_up", "moe_down")):
        shape = layers[name].shape
        layers[name].delete()
        w = random_mxfp4(jax.random.key(10 + i), shape, words=form != "mxfp4")
        layers[name] = dataclasses.replace(w, scales=pack_scales(w.scales)) if form == "mxfp4-scale-words" else w
    return params


def random_mxfp4(key, shape, words: bool = False) -> MXFP4:
    """An MXFP4 stack of matrices [..., K, N] (gpt-oss's packed experts): random codes, scales
    2^-7..2^-1; `words`: the codes as `mxfp4.pack_words` words (scales at most 128: `MXFP4.small_scales`)."""
    *lead, K, N = shape
    # One matrix at a time: a whole stack's bits in one draw take 4 bytes a code (25 GB for gpt-oss-20b's).
    pack = pack_words if words else lambda blocks: blocks
    draw = lambda key: (pack(jax.random.bits(key, (N, K // 2), jnp.uint8)),
                        jax.random.randint(key, (N, K // 32), 120, 127).astype(jnp.uint8))
    blocks, scales = jax.jit(lambda keys: jax.lax.map(draw, keys))(jax.random.split(key, math.prod(lead)))
    return MXFP4(blocks.reshape(*lead, *blocks.shape[-2:]), scales.reshape(*lead, N, K // 32), small_scales=words)


@functools.partial(jax.jit, static_argnums=(1,))
def block_means(x, block_size: int):
    """[L, ..., S, D] -> [L, ..., S / block_size, D]: the mean of each block's slots, one layer at a
    time (what KVCache.write keeps in k_cmp/v_cmp: of a pool, whose pages hold whole blocks)."""
    L, *lead, S, D = x.shape
    def body(layer, out):
        blocks = x[layer].reshape(*lead, S // block_size, block_size, D).astype(jnp.float32)
        return out.at[layer].set(blocks.mean(axis=-2).astype(x.dtype))
    return jax.lax.fori_loop(0, L, body, jnp.zeros((L, *lead, S // block_size, D), x.dtype))


def random_lengths(context: int) -> tuple[int, int, int]:
    """(max_len, cache slots, draft capacity k_max) of a random-state benchmark at `context`: room for
    256 new tokens and a draft tree's rows, and a k_max that holds any ratio up to 0.2, so one
    compiled capacity serves every ratio a benchmark sweeps."""
    max_len = context + 256
    return max_len, cache_slots(max_len + MAX_TREE_ROWS), SpecConfig(ratio=0.2, min_tokens=256).capacity(max_len)


def random_cache(cfg: ModelConfig, batch: int, num_slots: int, key: jax.Array, layers: int | None = None,
                 head=None, page_size: int = paging.DEFAULT_PAGE_SIZE) -> KVCache:
    """A cache full of random keys/values, standing in for a long prefill in latency benchmarks (only
    `layers` layers if given): a pool of `num_slots` slots a row, each row on its own consecutive pages
    (`kvcache.init_cache`'s layout: a batch's cache). For NSA configs k_cmp/v_cmp hold the block means
    of those keys/values, as the engine's cache writes keep them; with an EAGLE-3 `head` (its config)
    the head's one-layer cache too, under the same table."""
    if head is not None:
        own = random_cache(eagle.layer_config(head, cfg.dtype), batch, num_slots, jax.random.fold_in(key, 1),
                           page_size=page_size)
        return dataclasses.replace(random_cache(cfg, batch, num_slots, key, layers, page_size=page_size), head=own)
    pages = paging.contiguous_pages(batch, num_slots // page_size)
    shape = pool_shape(cfg, pages.size + 1, page_size)  # the null page too
    if layers is not None:
        shape = (layers,) + shape[1:]
    kk, kv = jax.random.split(key)
    k, v = random_layers(kk, shape, jnp.dtype(cfg.dtype)), random_layers(kv, shape, jnp.dtype(cfg.dtype))
    if cfg.nsa is None:
        return KVCache(k, v, pages, page_size=page_size)
    return KVCache(k, v, pages, block_means(k, cfg.nsa.block_size), block_means(v, cfg.nsa.block_size),
                   page_size=page_size)


def random_head(cfg: ModelConfig, seed: int = 2):
    """(config, params) of a random EAGLE-3 head at the model's shapes (EAGLE-3's: the model's width,
    heads and MLP, the default draft vocabulary), for timing and checks that need no good head."""
    head = eagle_training.head_config(cfg, eagle_training.default_draft_vocab(cfg.vocab_size))
    return head, eagle.init_params(jax.random.key(seed), head, jnp.dtype(cfg.dtype))


def cache_for(spec: SpecConfig, cache: KVCache) -> KVCache:
    """A prefilled cache as `spec`'s runs take it: the EAGLE-3 head's cache (`KVCache.head`) only for a
    spec that drafts with the head (method eagle, or auto's spec when its plan starts with eagle), so
    the other methods run the programs they always ran."""
    return cache if spec.eagle is not None else dataclasses.replace(cache, head=None)


def random_prompts(cfg: ModelConfig, batch: int, context: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (batch, context), dtype=np.int32), np.full((batch,), context, np.int32)


def random_state(params, cfg: ModelConfig, spec: SpecConfig, cache: KVCache, context: int, max_len: int) -> DecodeState:
    """A greedy decode state whose rows hold `context` random prompt tokens over `cache` (donated): a
    random cache stands in for their prefill in latency benchmarks. Rows never stop before max_len."""
    ids, lengths = random_prompts(cfg, cache.pages.shape[0], context)
    start, _ = decode_fns(cfg, spec, SamplingConfig(), max_len)
    return start(params, cache, jnp.asarray(ids), jnp.asarray(lengths), jax.random.key(0), spec.budget(),
                 max_new_tokens=jnp.int32(max_len - context), stop_ids=jnp.asarray([-1], jnp.int32))


# Headline benchmarks sample (greedy SmolLM2 loops at long context, inflating acceptance); greedy beside.
SAMPLINGS = {"sample": SamplingConfig(temperature=0.7, top_p=0.95), "greedy": SamplingConfig()}


def real_text_prompts(tokenizer, batch_size: int, prompt_tokens: int, heldout: bool = False) -> list[str]:
    """`batch_size` real-text continuation requests of about `prompt_tokens` tokens, a different
    document per row (`heldout`: only documents that trained heads never saw, `training.data`'s
    held-out split), before the chat template."""
    docs = split_documents()[1] if heldout else None
    return [corpus.long_prompt(tokenizer, prompt_tokens, task="continue", offset=3 * i, docs=docs)
            for i in range(batch_size)]


def real_text_batch(cfg, params, tokenizer, batch_size: int, prompt_tokens: int, new: int, backend: str, head=None,
                    heldout: bool = False):
    """(batch, max_len, prefilled cache) of `batch_size` real-text continuation prompts of about
    `prompt_tokens` tokens (a different document per row, chat template; `heldout`: only documents
    that trained heads never saw, `training.data`'s held-out split) with room for `new` tokens (and an
    EAGLE-3 `head`'s cache over them: `KVCache.head`, which only eagle's runs read)."""
    batch = encode_prompts(tokenizer, real_text_prompts(tokenizer, batch_size, prompt_tokens, heldout), chat=True)
    max_len = int(batch.lengths.max()) + new
    cache = prefill_fn(cfg, max_len, backend, 256, head)(params, jnp.asarray(batch.ids), jnp.asarray(batch.lengths))
    return batch, max_len, cache


def run_measures(run) -> tuple[dict, list[list[int]]]:
    """Decode tokens/s, tokens per iteration, iterations (the slowest row's and the mean), degeneration,
    decode time and a digest of the text of one `run_generation` (runs that should emit the same tokens,
    greedy ones on two machines say, show whether they did), and its generated tokens per row."""
    out = jax.device_get(run.output)
    generated = out.length - out.prompt_len
    iterations = max(int(out.stats.iterations.sum()), 1)
    rows = [out.tokens[b, out.prompt_len[b] : out.length[b]].tolist() for b in range(len(generated))]
    return {
        "decode_tokens_per_s": float(generated.sum() - len(generated)) / run.decode_s,
        "tokens_per_iteration": (int(out.stats.accepted.sum()) + iterations) / iterations,
        "acceptance_rate_by_depth": (out.stats.accepted_by_depth.sum(0) / iterations).tolist(),
        "iteration_ms": run.decode_s / max(int(out.stats.iterations.max()), 1) * 1e3,
        # a static batch runs until its slowest row is done: max against mean is the batch's tail
        "iterations_max": int(out.stats.iterations.max()),
        "iterations_mean": float(out.stats.iterations.mean()),
        "steps": int(generated.max()) - 1,
        "decode_s": run.decode_s,
        "load_s": run.load_s,  # the decode program's first calls, of no iterations: apart from decode_s
        "degeneration": repeated_4gram_share(rows),
        "text_digest": hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:12],
    }, rows


def median_of_runs(runs: list[dict]) -> dict:
    """Median decode tokens/s with its spread (max - min), and the medians of the other measures
    (run_measures')."""
    tps = [r["decode_tokens_per_s"] for r in runs]
    medians = {k: statistics.median(r[k] for r in runs)
               for k in ("tokens_per_iteration", "iteration_ms", "degeneration", "iterations_max", "iterations_mean")}
    return {"decode_tokens_per_s": statistics.median(tps), "spread_tokens_per_s": max(tps) - min(tps), **medians}


def repeated_4gram_share(rows: list[list[int]]) -> float:
    """Degeneration: the share of 4-grams in the outputs that already occurred earlier in the same output."""
    seen_total = repeats = 0
    for row in rows:
        seen = set()
        for i in range(len(row) - 3):
            gram = tuple(row[i : i + 4])
            repeats += gram in seen
            seen.add(gram)
            seen_total += 1
    return repeats / max(seen_total, 1)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (header, key, format)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else format(value, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
