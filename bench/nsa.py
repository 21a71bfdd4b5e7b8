"""NSA decode/verification passes against their floor and dense attention; one NSA layer against peers.

Peers: XunhaoLai/native-sparse-attention-triton's decode ops and fla's parallel_nsa.

    PYTHONPATH=. python3 bench/nsa.py [--parts steps,layers,peers] [--models nsa-1b,nsa-8b]
        [--grid default|full|BxC,...] [--layer-grid default|full|BxC,...] [--rows 1,16]
        [--backend pallas] [--budget SECONDS] [--tiny] [--out DIR]

Shapes (random bf16 weights, latency only):
  nsa-1b  NSA-1B: hidden 2048, 16 layers, 32 q / 2 kv heads, head_dim 64, ffn 8192 (assumed), vocab
          128256, tied embeddings, rope theta 500000; NSA block 16, 16 selected blocks, window 128.
  nsa-8b  Qwen3-8B-like: hidden 4096, 36 layers, 32 q / 2 kv heads, head_dim 128, ffn 12288, vocab
          151936, untied, no qk-norm (llama-nsa), rope theta 1e6; NSA block 64, 16 blocks, window 512.
  Both use the nsa1b selection rule (NSAConfig's default). "dense" is the same config as model_type
  "llama" (no NSA, no gate columns), full attention over the cache.

Parts:
  steps   a jitted loop of STEPS forward passes (decoder.forward + logits + argmax fed back) over a
          random cache sized to the context (k_cmp/v_cmp = block means of the random keys/values):
          T = 1 (a plain decode step; the engine's plain step adds only sampling and the commit) and
          T = 16 rows (a verification pass), NSA and dense; ms per pass, the floor (docs/development.md,
          "Measurement protocol") and NSA/dense. NSA floor = (weights + compressed keys/values of the
          visible blocks + S selected blocks (S*block*Hkv*Dh*2 for k+v) + window (w + T - 1 keys) +
          float32 logits) / measured copy bandwidth, all layers and rows; for T > 1 the S blocks are a
          lower bound (the rows' union). Dense floor = (weights + every key/value up to the last row +
          logits) / bandwidth.
  layers  jaxspec's NSA attention of one layer alone (jaxspec.models.nsa.attend_fn: compressed branch,
          selection, selected + window + gates), T = 1 and 16, and the dense attention of one layer
          (pallas verify kernel) on the same cache; microseconds per layer call.
  peers   the same layer with XunhaoLai/native-sparse-attention-triton's decode ops (eager PyTorch, as
          its inference code calls them, cache tensors laid out as its NSACache holds them) and fla's
          parallel_nsa (fla-core, cached-inference form: q = the last T tokens of k/v). Needs CUDA and
          torch; Lai's tree in .peers/native-sparse-attention-triton (an ignored folder: export it with
            git --git-dir=<mirror of github:XunhaoLai/native-sparse-attention-triton> archive HEAD \
              | tar -x -C .peers/native-sparse-attention-triton
          and carry `.peers` to the GPU machine). Lai is configured as jaxspec's NSA: kernel_size =
          kernel_stride = block_size (non-overlapping mean pooling: its avgpool_compress), init_blocks 0,
          local_blocks 1 (only the query's own block forced), so its selection is jaxspec's "exact"
          rule; its output is checked against jaxspec's (exact rule) on the same data. Where the block
          is a multiple of 32 (the 8B shape) its README configuration (kernel 32, stride 16, init 1,
          local 2: overlapping compression, about twice the compressed entries) is timed as well
          (lai_readme_us).

Grids (BxC = batch x context): --grid is the steps grid, --layer-grid the layers/peers grid; "full"
is batches 1, 4, 16 x contexts 8K..128K; configurations that do not fit memory are skipped. The
default grids take about 8 minutes on an H100. Every item runs in its own try/except; items past
--budget seconds are skipped; DIR/nsa_<device>.json is rewritten after every item. A markdown
table comes last. --tiny: tiny shapes on the reference backend (a CPU smoke test of this script;
on a CPU the Lai peer runs its PyTorch ops with a PyTorch stand-in for its Triton selected-block
kernel, to check the data layout and configuration against jaxspec, not for time).
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory for torch
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")  # 8B x 16 x 64K needs ~55 GB

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from bench import common  # noqa: E402
import pallas_kernels as kernels  # noqa: E402
from pallas_kernels import paging  # noqa: E402
from jaxspec.models import decoder, nsa  # noqa: E402
from jaxspec.models.config import ModelConfig, NSAConfig, RopeConfig  # noqa: E402
from jaxspec.models.kvcache import cache_bytes, cache_slots  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAI_DIR = ROOT / ".peers" / "native-sparse-attention-triton"
PYLIB_DIR = ROOT / ".peers" / "pylib"  # fallback copies of pure-Python deps (einops), appended to sys.path

NSA_1B = common.LLAMA_1B.replace(model_type="llama-nsa", nsa=NSAConfig(block_size=16, block_counts=16, window_size=128))
NSA_8B = ModelConfig(
    model_type="llama-nsa", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=2,
    head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
    max_position_embeddings=262144, tie_word_embeddings=False, dtype="bfloat16",
    nsa=NSAConfig(block_size=64, block_counts=16, window_size=512),
)
TINY_1B = NSA_1B.replace(vocab_size=1024, hidden_size=128, num_layers=2, head_dim=16, intermediate_size=256,
                         nsa=NSAConfig(block_size=16, block_counts=4, window_size=32))
TINY_8B = NSA_8B.replace(vocab_size=1024, hidden_size=128, num_layers=2, head_dim=32, intermediate_size=256,
                         nsa=NSAConfig(block_size=32, block_counts=4, window_size=64))
MODELS = {"nsa-1b": NSA_1B, "nsa-8b": NSA_8B}
TINY_MODELS = {"nsa-1b": TINY_1B, "nsa-8b": TINY_8B}

K = 1024
FULL_GRID = [(b, c * K) for b in (1, 4, 16) for c in (8, 16, 32, 64, 128)]
STEP_GRID = [(1, 8 * K), (1, 32 * K), (1, 128 * K), (4, 32 * K), (16, 32 * K)]
LAYER_GRID = [(1, 8 * K), (1, 32 * K), (1, 128 * K), (16, 32 * K)]
TINY_GRID = [(1, 256), (2, 512)]
STEPS = 16            # forward passes per timed call (steps part)
LAYER_STEPS = 8       # scan steps per timed call (layers part), LAYERS layer calls each
LAYERS = 2            # cache layers of the layers part; calls alternate between them
MEMORY_FRACTION = 0.85
MIN_RUN_S = 0.05


# ---------------------------------------------------------------- bookkeeping

class Bench:
    """Collects rows, guards every item (errors and the time budget), keeps the JSON current."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.result = common.run_info() | {"rates": None, "models": {}, "steps": [], "layers": [],
                                           "errors": [], "skipped": [], "notes": []}
        self.path = Path(args.out) / f"nsa_{device_suffix(self.result['device'])}.json"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self, what: str) -> bool:
        if self.elapsed() <= self.args.budget:
            return False
        self.result["skipped"].append(what)
        print(f"[{self.elapsed():6.1f}s] SKIP {what} (budget {self.args.budget:.0f} s)", flush=True)
        return True

    def run(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), or None after recording its error (one failure must not end the run)."""
        if self.over_budget(what):
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            lines = "".join(traceback.format_exception_only(e)).strip().splitlines()
            message = "\n".join(lines[:4])[:600]
            self.result["errors"].append({"item": what, "error": message})
            print(f"[{self.elapsed():6.1f}s] ERROR {what}: {message}", flush=True)
            return None
        finally:
            self.save()

    def note(self, text: str):
        if text not in self.result["notes"]:
            self.result["notes"].append(text)
            print(f"note: {text}", flush=True)

    def save(self):
        common.write_json(self.path, self.result)


def device_suffix(kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", kind)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def device_bytes_limit() -> int:
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 1 << 62)


def parse_grid(text: str, default):
    if text in (None, "default"):
        return default
    if text == "full":
        return FULL_GRID
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]


def dense_of(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(model_type="llama", nsa=None)


def describe(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------- bytes and floors

def step_floor(cfg: ModelConfig, weight_bytes: int, batch: int, context: int, T: int, bandwidth_GBps: float) -> dict:
    """The step floor (docs/development.md, "Measurement protocol"): (weights + attention reads + float32
    logits) / measured copy bandwidth."""
    parts = {k: cfg.num_layers * v for k, v in common.layer_attention_bytes(cfg, batch, context, T).items()}
    parts |= {"weights": weight_bytes, "logits": batch * T * cfg.vocab_size * 4}
    total = sum(parts.values())
    return {"bytes": total, "bytes_by_part": parts, "floor_ms": total / (bandwidth_GBps * 1e9) * 1e3}


# ---------------------------------------------------------------- random caches

# ---------------------------------------------------------------- part 1: steps

@functools.lru_cache(maxsize=None)
def passes_fn(cfg: ModelConfig, backend: str, T: int, steps: int):
    """jit(params, cache, tokens [B, T], start [B]) -> (cache, tokens): `steps` forward passes of T
    rows at positions start + i + (0..T-1) (pass i), each with the LM head and its argmax fed back as
    the next pass's tokens (so XLA can neither hoist nor drop a pass). The cache is donated."""
    def run(params, cache, tokens, start):
        B = tokens.shape[0]

        def body(i, carry):
            cache, tokens = carry
            positions = (start + i)[:, None] + jnp.arange(T, dtype=jnp.int32)
            attend = decoder.attention(cfg, positions, backend)
            hidden, cache, _ = decoder.forward(params, cfg, tokens, positions, jnp.ones((B, T), bool), cache, attend,
                                               backend=backend)
            return cache, jnp.argmax(decoder.logits(params, cfg, hidden), axis=-1).astype(jnp.int32)

        return lax.fori_loop(0, steps, body, (cache, tokens))

    return jax.jit(run, donate_argnums=1)


def time_passes(params, cfg, backend, cache, batch, context, T):
    """(seconds per pass, compile + first call seconds, the cache back)."""
    f = passes_fn(cfg, backend, T, STEPS)
    tokens = jnp.zeros((batch, T), jnp.int32)
    start = jnp.full((batch,), context - 1, jnp.int32)  # row 0 is the pending token at context - 1
    t = time.perf_counter()
    cache, out = jax.block_until_ready(f(params, cache, tokens, start))
    first = time.perf_counter() - t
    times = []
    for _ in range(3):
        t = time.perf_counter()
        cache, out = jax.block_until_ready(f(params, cache, tokens, start))
        times.append((time.perf_counter() - t) / STEPS)
    return statistics.median(times), first, cache


def dense_params(params, cfg: ModelConfig):
    """The NSA params without the gate columns of wqkv: the dense model's params (other leaves shared)."""
    gates = decoder.gate_dim(cfg)
    layers = dict(params["layers"]) | {"wqkv": params["layers"]["wqkv"][..., :-gates]}
    if "bqkv" in layers:
        layers["bqkv"] = layers["bqkv"][..., :-gates]
    return dict(params) | {"layers": layers}


def steps_part(bench: Bench, name: str, cfg: ModelConfig, grid, rows, backend: str):
    dcfg = dense_of(cfg)
    params = bench.run(f"{name} params", decoder.init_params, cfg, jax.random.key(0))
    if params is None:
        return
    dparams = dense_params(params, cfg)
    weights, dweights = common.tree_bytes(params), common.tree_bytes(dparams)
    extra = common.tree_bytes(dparams["layers"]["wqkv"])
    bw = bench.result["rates"]["copy_GBps"]
    limit = MEMORY_FRACTION * device_bytes_limit()
    for batch, context in grid:
        slots = cache_slots(context + STEPS + max(rows))
        need = weights + extra + cache_bytes(cfg, batch, slots) + 3 * batch * max(rows) * cfg.vocab_size * 4
        base = dict(model=name, batch=batch, context=context)
        if need > limit:
            for T in rows:
                bench.result["steps"].append(base | dict(T=T, skipped=f"memory: needs {need / 2**30:.1f} GiB"))
            print(f"[{bench.elapsed():6.1f}s] SKIP {name} B={batch} C={context}: needs {need / 2**30:.1f} GiB "
                  f"> {limit / 2**30:.1f} GiB", flush=True)
            continue
        if bench.over_budget(f"steps {name} B={batch} C={context}"):
            continue
        cache = bench.run(f"{name} cache B={batch} C={context}", common.random_cache, cfg, batch, slots,
                          jax.random.key(batch * 7 + context))
        if cache is None:
            continue
        by_T = {T: base | dict(T=T) for T in rows}
        for kind, kcfg, kparams, kweights in (("nsa", cfg, params, weights), ("dense", dcfg, dparams, dweights)):
            if kind == "dense":
                cache = dataclasses.replace(cache, k_cmp=None, v_cmp=None)  # the compressed blocks are dropped
            for T in rows:
                row = by_T[T]
                label = f"{name} {kind} B={batch} C={context} T={T}"
                if cache.k.is_deleted():  # donated by a call that failed
                    cache = common.random_cache(kcfg, batch, slots, jax.random.key(batch * 7 + context))
                got = bench.run(label, time_passes, kparams, kcfg, backend, cache, batch, context, T)
                if got is None:
                    row.setdefault("error", f"{kind} failed (see errors)")
                    continue
                step, first, cache = got
                floor = step_floor(kcfg, kweights, batch, context, T, bw)
                row |= {f"{kind}_ms": step * 1e3, f"{kind}_floor_ms": floor["floor_ms"],
                        f"{kind}_x_floor": step * 1e3 / floor["floor_ms"], f"{kind}_compile_s": first,
                        f"{kind}_floor_bytes": floor["bytes_by_part"]}
                if T == 1:
                    row[f"{kind}_tok_s"] = batch / step
                print(f"[{bench.elapsed():6.1f}s] {label}: {step * 1e3:8.3f} ms/pass, floor {floor['floor_ms']:.3f} ms "
                      f"({step * 1e3 / floor['floor_ms']:.2f}x), first call {first:.1f} s", flush=True)
        for row in by_T.values():
            if "nsa_ms" in row and "dense_ms" in row:
                row["nsa_over_dense_speed"] = row["dense_ms"] / row["nsa_ms"]
            bench.result["steps"].append(row)
        bench.save()
        del cache
        gc.collect()
    del params, dparams
    gc.collect()


# ---------------------------------------------------------------- part 2: one layer, jaxspec

def time_layer_calls(step, state) -> float:
    """Microseconds per layer call: step(state, i, layer) runs LAYER_STEPS x LAYERS times in one scan;
    the layer alternates (static index), the query changes every call, every output is kept."""
    def run(state):
        body = lambda carry, i: (carry, [step(state, i, layer) for layer in range(LAYERS)])
        return lax.scan(body, 0, jnp.arange(LAYER_STEPS))[1]
    return common.seconds_per_call(jax.jit(run), state, min_run_s=MIN_RUN_S) / (LAYER_STEPS * LAYERS) * 1e6


def layer_state(cfg: ModelConfig, batch: int, context: int, T_max: int):
    """LAYERS layers of random cache with room for rows at context - 1 .. context + T_max - 2, the
    queries of every call, the gates (after the sigmoid) and the rows' positions."""
    key = jax.random.key(batch * 131 + context)
    ks = jax.random.split(key, 3)
    cache = common.random_cache(cfg, batch, cache_slots(context + T_max), ks[0], layers=LAYERS)
    q = jax.random.normal(ks[1], (LAYER_STEPS, LAYERS, batch, T_max, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    gates = jax.nn.sigmoid(jax.random.normal(ks[2], (batch, T_max, cfg.num_heads, 3), jnp.float32))
    pos = jnp.broadcast_to(context - 1 + jnp.arange(T_max, dtype=jnp.int32), (batch, T_max))
    return {"cache": cache, "q": q, "gates": gates, "pos": pos}


def time_jaxspec_nsa(st, cfg: ModelConfig, T: int, backend: str) -> float:
    attend = nsa.attend_fn(cfg, st["pos"][:, :T], backend)
    return time_layer_calls(lambda s, i, layer: attend(layer, s["q"][i, layer, :, :T], s["cache"], None,
                                                       s["gates"][:, :T], ())[0], st)


def time_jaxspec_dense(st, cfg: ModelConfig, T: int, backend: str) -> float:
    attend = decoder.attention(dense_of(cfg), st["pos"][:, :T], backend)
    dense = {"q": st["q"], "cache": dataclasses.replace(st["cache"], k_cmp=None, v_cmp=None)}
    return time_layer_calls(lambda s, i, layer: attend(layer, s["q"][i, layer, :, :T], s["cache"], None, None, ())[0],
                            dense)


def jaxspec_exact_output(st, cfg: ModelConfig, backend: str):
    """Layer 0, call 0, row 0 with the exact top-S rule (Lai's selection): out [B, Hq, Dh] and the
    selected blocks [B, Hkv, S] (-1: none)."""
    n = cfg.nsa

    @jax.jit
    def run(q, cache, gates, pos):
        scale = cfg.head_dim ** -0.5
        o_cmp, _, idx = kernels.nsa_compressed_attention(
            q, cache.k_cmp, cache.v_cmp, cache.pages, 0, pos, page_size=cache.page_size, block_size=n.block_size,
            block_counts=n.block_counts, rule="exact", scale=scale, backend=backend)
        out = kernels.nsa_selected_attention(q, cache.k, cache.v, cache.pages, 0, pos, idx, o_cmp, gates,
                                             page_size=cache.page_size, block_size=n.block_size,
                                             window=n.window_size, scale=scale, backend=backend)
        return out[:, 0], idx[:, 0]

    return run(st["q"][0, 0, :, :1], st["cache"], st["gates"][:, :1], st["pos"][:, :1])


# ---------------------------------------------------------------- part 3: peers (PyTorch)

def torch_or_none():
    try:
        import torch
        return torch
    except ImportError:
        return None


def torch_seconds(fn, sync, min_run_s: float = MIN_RUN_S) -> float:
    """Median over 3 runs of back-to-back eager calls fn(i), each run at least min_run_s long."""
    fn(0)
    fn(1)
    sync()

    def run(n):
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        sync()
        return (time.perf_counter() - start) / n

    n = max(4, min(2000, math.ceil(min_run_s / run(4))))
    return statistics.median(run(n) for _ in range(3))


def import_lai():
    """Lai's `native_sparse_attention.ops` (only its ops modules), or a reason why not."""
    if not (LAI_DIR / "native_sparse_attention" / "ops" / "__init__.py").exists():
        return None, f"Lai's tree is not in {LAI_DIR} (export it there and carry .peers)"
    for path in (str(LAI_DIR),):
        if path not in sys.path:
            sys.path.insert(0, path)
    if PYLIB_DIR.exists() and str(PYLIB_DIR) not in sys.path:
        sys.path.append(str(PYLIB_DIR))  # installed packages win; the copies only fill gaps (einops)
    try:
        import native_sparse_attention.ops as ops
        from native_sparse_attention.ops.triton import flash_attention_decode as fad
    except Exception as e:  # noqa: BLE001
        return None, f"importing native_sparse_attention.ops failed: {type(e).__name__}: {e}"
    return (ops, fad), None


def lai_commit() -> str | None:
    f = LAI_DIR / "COMMIT"
    return f.read_text().strip() if f.exists() else None


def to_torch(x):
    import torch
    return torch.from_dlpack(x)


@dataclasses.dataclass
class LaiCache:
    """One layer's decode cache as Lai's NSACache holds it (module/kv_cache.py), batch rows only:
    compress [2, B, n_cmp, Hkv, Dh], sparse [2, B, N, Hkv, Dh], sliding [2, B, window, Hkv, Dh] (a ring
    buffer: order does not matter to attention) and their int32 lengths."""
    compress: object
    compress_len: object
    sparse: object
    sparse_len: object
    sliding: object
    sliding_len: object
    seqlens: object  # length of each sequence including the current token (inference_func: cu_seqlens + step)


def lai_caches(st, cfg: ModelConfig, context: int, kernel_size: int, kernel_stride: int, torch):
    """Lai-layout copies of the layers of st["cache"] (token-major), for a query at context - 1 whose
    key/value are already in the cache (Lai updates the cache before attending). With kernel_size =
    kernel_stride = block_size the compressed entries are jaxspec's block means; otherwise random
    (timing only)."""
    n = cfg.nsa
    B = st["q"].shape[2]
    cache = st["cache"]
    caches = []
    for layer in range(LAYERS):
        k, v = (to_torch(x).permute(0, 2, 1, 3)[:, :context] for x in cache.view(layer))  # [B, C, Hkv, Dh]
        sparse = torch.stack([k, v]).contiguous()
        w = min(n.window_size, context)
        sliding = sparse[:, :, context - w:].contiguous()
        if kernel_size == kernel_stride == n.block_size:
            n_cmp = context // n.block_size
            kc, vc = (to_torch(paging.layer_view(x, layer, cache.pages, cache.page_size // n.block_size))
                      .permute(0, 2, 1, 3)[:, :n_cmp] for x in (cache.k_cmp, cache.v_cmp))
            compress = torch.stack([kc, vc]).contiguous()
        else:
            n_cmp = (context - kernel_size) // kernel_stride + 1
            compress = torch.randn(2, B, n_cmp, cfg.num_kv_heads, cfg.head_dim, dtype=sparse.dtype, device=sparse.device)
        full = lambda value: torch.full((B,), value, dtype=torch.int32, device=sparse.device)
        caches.append(LaiCache(compress, full(n_cmp), sparse, full(context), sliding, full(context), full(context)))
    return caches


def lai_layer(ops, cache: LaiCache, q, g, *, kernel_size, kernel_stride, block_size, topk, init_blocks,
              local_blocks, window):
    """One layer of Lai's NSA decode attention: the step > 0 branches of compressed_attention_infer,
    topk_sparse_attention_infer and sliding_window_attention_infer (infer/inference_func.py) and the gated
    sum of nsa_infer (infer/nsa_inference.py), as written there; the compression of a newly completed
    block, RoPE and the cache update are not timed (as on the jaxspec side). q [B, Hq, Dh], g [B, Hq, 3]."""
    import torch
    B = q.shape[0]
    n_cmp = cache.compress_len[:B].max()
    o_cmp, topk_idx = ops.compressed_attention_decode(
        q, cache.compress[0, :B, :n_cmp], cache.compress[1, :B, :n_cmp], cache.seqlens, cache.compress_len[:B],
        kernel_size, kernel_stride, block_size, topk, init_blocks, local_blocks)
    o_slc = ops.topk_sparse_attention_decode(q, cache.sparse[0, :B], cache.sparse[1, :B], topk_idx, block_size,
                                             cache.sparse_len[:B])
    o_swa = ops.flash_attention_decode(q, cache.sliding[0, :B], cache.sliding[1, :B],
                                       torch.minimum(cache.sliding_len, torch.zeros_like(cache.sliding_len) + window)[:B])
    out = g[..., 0, None] * o_cmp + g[..., 1, None] * o_slc + g[..., 2, None] * o_swa
    return out, topk_idx


def torch_selected_decode(q, k, v, topk_idx, block_size, seqlens, sm_scale=None):
    """A PyTorch stand-in (CPU check only) for Lai's Triton topk_sparse_attention_decode, same arguments:
    q [B, Hq, Dh], k/v [B, N, Hkv, Dh], topk_idx [Hkv, B, S] (-1: padding), seqlens [B]."""
    import torch
    B, Hq, D = q.shape
    N, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = sm_scale or D ** -0.5
    pos = torch.arange(N, device=q.device)
    chosen = (topk_idx.permute(1, 0, 2).long()[..., None] == (pos // block_size)).any(dim=2)  # [B, Hkv, N]
    chosen &= pos < seqlens[:, None, None]
    logits = torch.einsum("bhgd,bnhd->bhgn", q.view(B, Hkv, G, D).float(), k.float()) * scale
    p = torch.softmax(logits.masked_fill(~chosen[:, :, None], -torch.inf), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgn,bnhd->bhgd", p, v.float()).reshape(B, Hq, D).to(q.dtype)


def lai_settings(cfg: ModelConfig, readme: bool = False) -> dict:
    n = cfg.nsa
    if readme:  # its README's configuration (block 64): overlapping kernels, first + 2 local blocks forced
        return dict(kernel_size=32, kernel_stride=16, block_size=n.block_size, topk=n.block_counts, init_blocks=1,
                    local_blocks=2, window=n.window_size)
    return dict(kernel_size=n.block_size, kernel_stride=n.block_size, block_size=n.block_size, topk=n.block_counts,
                init_blocks=0, local_blocks=1, window=n.window_size)


def peer_lai(bench: Bench, st, cfg: ModelConfig, batch: int, context: int, row: dict, backend: str):
    """Times Lai's decode ops for one layer (T = 1) on the data of `st`, and checks its output and
    selection against jaxspec's exact-rule NSA on the same data."""
    torch = torch_or_none()
    if torch is None:
        return bench.note("peers: torch is not installed; Lai and fla skipped")
    got, why = import_lai()
    if got is None:
        return bench.note(f"Lai skipped: {why}")
    ops, fad = got
    cuda = torch.cuda.is_available() and jax.default_backend() == "gpu"
    if not cuda:
        if not bench.args.tiny:
            return bench.note("Lai skipped: needs CUDA (its decode kernels are Triton)")
        from types import SimpleNamespace
        ops = SimpleNamespace(compressed_attention_decode=ops.compressed_attention_decode,
                              topk_sparse_attention_decode=torch_selected_decode,
                              flash_attention_decode=fad.torch_attention_decode)
        bench.note("Lai on CPU: its PyTorch compressed_attention_decode and torch_attention_decode, with "
                   "bench/nsa.py's torch_selected_decode for the Triton selected-block kernel (a layout and "
                   "configuration check; the times are not comparable)")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    settings = lai_settings(cfg)
    caches = lai_caches(st, cfg, context, settings["kernel_size"], settings["kernel_stride"], torch)
    qs = [to_torch(st["q"][0, layer, :, 0]).contiguous() for layer in range(LAYERS)]  # [B, Hq, Dh]
    g = to_torch(st["gates"][:, 0]).to(torch.bfloat16).contiguous()  # [B, Hq, 3]
    with torch.no_grad():
        out, topk_idx = lai_layer(ops, caches[0], qs[0], g, **settings)
        want_out, want_idx = jaxspec_exact_output(st, cfg, "reference" if bench.args.tiny else backend)
        got_sets = topk_idx.permute(1, 0, 2).cpu().numpy().reshape(batch * cfg.num_kv_heads, -1)  # per (row, kv head)
        want_sets = np.asarray(want_idx).reshape(batch * cfg.num_kv_heads, -1)
        same = [set(a[a >= 0].tolist()) == set(b[b >= 0].tolist()) for a, b in zip(got_sets, want_sets)]
        want = np.asarray(want_out.astype(jnp.float32))
        diff = np.abs(out.float().cpu().numpy() - want)
        row["lai_select_agree"] = float(np.mean(same))
        row["lai_rel_err"] = float(diff.max() / np.abs(want).max())
        # rows (b, kv head) with the same selection: the error of the arithmetic alone
        same_heads = np.asarray(same).reshape(batch, cfg.num_kv_heads)
        mask = np.repeat(same_heads, cfg.group_size, axis=1)[..., None]
        if mask.any():
            row["lai_rel_err_same_selection"] = float((diff * mask).max() / np.abs(want).max())
        us = torch_seconds(lambda i: lai_layer(ops, caches[i % LAYERS], qs[i % LAYERS], g, **settings), sync) * 1e6
        row["lai_us"] = us
        print(f"[{bench.elapsed():6.1f}s] lai B={batch} C={context}: {us:9.1f} us/layer; selection agrees "
              f"{100 * row['lai_select_agree']:.1f}%, rel err {row['lai_rel_err']:.2e}", flush=True)
        if cfg.nsa.block_size % 32 == 0 and context >= 64:  # its README's kernel 32 / stride 16 needs block % 32 == 0
            readme = lai_settings(cfg, readme=True)
            caches = lai_caches(st, cfg, context, readme["kernel_size"], readme["kernel_stride"], torch)
            us = torch_seconds(lambda i: lai_layer(ops, caches[i % LAYERS], qs[i % LAYERS], g, **readme), sync) * 1e6
            row["lai_readme_us"] = us
            print(f"[{bench.elapsed():6.1f}s] lai README config B={batch} C={context}: {us:9.1f} us/layer", flush=True)
    caches = qs = g = None  # freed before the next bench (rebound, not deleted: the lambdas above read them)
    if cuda:
        torch.cuda.empty_cache()


def peer_fla(bench: Bench, st, cfg: ModelConfig, batch: int, context: int, T: int, row: dict):
    """fla's parallel_nsa in its cached-inference form: q [B, T, Hq, Dh] are the last T tokens of
    k/v [B, context + T - 1, Hkv, Dh]; it mean-pools the whole k/v each call (its API has no cache of
    compressed blocks). The window branch needs flash_attn; without it the window is left out."""
    torch = torch_or_none()
    if torch is None or not torch.cuda.is_available() or jax.default_backend() != "gpu":
        return bench.note("fla skipped: needs CUDA and torch")
    try:
        from fla.ops.nsa import parallel_nsa
        from fla.ops.nsa import parallel as fla_parallel
        import fla
    except Exception as e:  # noqa: BLE001
        return bench.note(f"fla skipped: import failed: {type(e).__name__}: {e}")
    bench.result.setdefault("fla_version", getattr(fla, "__version__", None))
    n = cfg.nsa
    window = n.window_size
    if getattr(fla_parallel, "flash_attn_func", None) is None:
        window = 0
        bench.note("fla: flash_attn is not installed, so its window branch is left out (window_size=0)")
    tk = context + T - 1
    views = [st["cache"].view(layer) for layer in range(LAYERS)]
    ks, vs = ([to_torch(view[i]).permute(0, 2, 1, 3)[:, :tk].contiguous() for view in views] for i in (0, 1))
    qs = [to_torch(st["q"][0, layer, :, :T]).contiguous() for layer in range(LAYERS)]
    g = to_torch(st["gates"][:, :T]).to(torch.bfloat16)
    g_cmp, g_slc, g_swa = (g[..., i].contiguous() for i in range(3))

    def call(i):
        layer = i % LAYERS
        return parallel_nsa(qs[layer], ks[layer], vs[layer], g_cmp, g_slc, g_swa, block_counts=n.block_counts,
                            block_size=n.block_size, window_size=window)

    try:
        with torch.no_grad():
            us = torch_seconds(call, torch.cuda.synchronize) * 1e6
    except AssertionError as e:  # e.g. parallel_nsa_topk's "BC (16) must be >= 2 * S (32)" at block 16
        row["fla_note"] = f"fla refuses: {e}"[:200]
        bench.note(f"fla at block {cfg.nsa.block_size}, {cfg.nsa.block_counts} blocks: {row['fla_note']}")
        us = None
    finally:
        views = ks = vs = qs = g = g_cmp = g_slc = g_swa = None  # freed (rebound: `call` reads them)
        torch.cuda.empty_cache()
    if us is not None:
        row["fla_us"] = us
        if window == 0:
            row["fla_note"] = "no window (flash_attn missing)"
        print(f"[{bench.elapsed():6.1f}s] fla B={batch} C={context} T={T}: {us:9.1f} us/layer", flush=True)


def layers_part(bench: Bench, name: str, cfg: ModelConfig, grid, rows, backend: str, parts):
    bw = bench.result["rates"]["copy_GBps"]
    exact = cfg.replace(nsa=dataclasses.replace(cfg.nsa, topk_rule="exact"))
    limit = MEMORY_FRACTION * device_bytes_limit()
    for batch, context in grid:
        what = f"layers {name} B={batch} C={context}"
        need = 4 * cache_bytes(cfg, batch, cache_slots(context + max(rows))) * LAYERS // cfg.num_layers
        if need > limit:
            bench.result["layers"].append(dict(model=name, batch=batch, context=context, skipped="memory"))
            continue
        st = bench.run(f"{what} inputs", layer_state, cfg, batch, context, max(rows))
        if st is None:
            continue
        for T in rows:
            row = dict(model=name, batch=batch, context=context, T=T)
            parts_bytes = common.layer_attention_bytes(cfg, batch, context, T)
            row["floor_us"] = sum(parts_bytes.values()) / (bw * 1e9) * 1e6
            row["dense_floor_us"] = common.layer_attention_bytes(dense_of(cfg), batch, context, T)["kv"] / (bw * 1e9) * 1e6
            if "layers" in parts:
                us = bench.run(f"{what} T={T} jaxspec nsa", time_jaxspec_nsa, st, cfg, T, backend)
                if us is not None:
                    row["jaxspec_us"] = us
                    row["x_floor"] = us / row["floor_us"]
                if T == 1:
                    row["jaxspec_exact_us"] = bench.run(f"{what} T={T} jaxspec nsa exact", time_jaxspec_nsa, st, exact,
                                                        T, backend)
                row["dense_us"] = bench.run(f"{what} T={T} jaxspec dense", time_jaxspec_dense, st, cfg, T, backend)
                print(f"[{bench.elapsed():6.1f}s] {what} T={T}: jaxspec nsa {row.get('jaxspec_us') or float('nan'):8.1f} us "
                      f"(floor {row['floor_us']:.1f}), dense {row.get('dense_us') or float('nan'):8.1f} us", flush=True)
            if "peers" in parts:
                if T == 1:
                    bench.run(f"{what} lai", peer_lai, bench, st, cfg, batch, context, row, backend)
                bench.run(f"{what} T={T} fla", peer_fla, bench, st, cfg, batch, context, T, row)
            for peer in ("lai", "fla"):
                if row.get(f"{peer}_us") and row.get("jaxspec_us"):
                    row[f"{peer}_over_jaxspec"] = row[f"{peer}_us"] / row["jaxspec_us"]
            bench.result["layers"].append(row)
            bench.save()
        del st
        gc.collect()


# ---------------------------------------------------------------- report

STEP_COLUMNS = [("NSA ms", "nsa_ms", ".3f"), ("floor ms", "nsa_floor_ms", ".3f"), ("x floor", "nsa_x_floor", ".2f"),
                ("dense ms", "dense_ms", ".3f"), ("NSA/dense speed", "nsa_over_dense_speed", ".2f")]
LAYER_COLUMNS = [("layer jaxspec us", "jaxspec_us", ".1f"), ("layer floor us", "floor_us", ".1f"), ("Lai us", "lai_us", ".1f"),
                 ("Lai/jaxspec", "lai_over_jaxspec", ".2f"), ("fla us", "fla_us", ".1f")]


def markdown(result) -> str:
    rates = result.get("rates") or {}
    head = (f"{result['device']}, copy {rates.get('copy_GBps', 0):.0f} GB/s, bf16 matmul "
            f"{rates.get('matmul_TFLOPs', 0):.0f} TFLOP/s, {result['date']}; per-layer us: one layer's attention "
            f"(T = 1 for Lai)")
    steps = {(r["model"], r["batch"], r["context"], r["T"]): r for r in result["steps"]}
    layers = {(r["model"], r["batch"], r["context"], r.get("T", 1)): r for r in result["layers"]}
    keys = sorted(set(steps) | set(layers), key=lambda k: (k[0], k[3], k[1], k[2]))
    rows = []
    for key in keys:
        s, l = steps.get(key, {}), layers.get(key, {})
        note = s.get("skipped") or s.get("error") or l.get("skipped") or l.get("fla_note") or ""
        if l.get("lai_select_agree") is not None:
            note = (note + "; " if note else "") + f"Lai selection {100 * l['lai_select_agree']:.0f}% same"
        rows.append(dict(zip(("model", "batch", "context", "T"), key), note=note,
                         **{k: s.get(k) for _, k, _ in STEP_COLUMNS}, **{k: l.get(k) for _, k, _ in LAYER_COLUMNS}))
    columns = [("model", "model", "s"), ("B", "batch", "d"), ("context", "context", "d"), ("T", "T", "d"),
               *STEP_COLUMNS, *LAYER_COLUMNS, ("note", "note", "s")]
    return "\n".join([head, "", common.markdown_table(rows, columns)])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="steps,layers,peers", type=lambda s: s.split(","))
    p.add_argument("--models", default="nsa-1b,nsa-8b", type=lambda s: s.split(","))
    p.add_argument("--grid", default="default", help="steps grid: default, full, or BxC,... (e.g. 1x8192,4x32768)")
    p.add_argument("--layer-grid", default="default", help="layers/peers grid: default, full, or BxC,...")
    p.add_argument("--rows", default="1,16", type=lambda s: [int(x) for x in s.split(",")],
                   help="query rows per pass: 1 (decode) and a verification width (<= 16)")
    p.add_argument("--backend", default=None, help="kernel backend (default pallas; reference with --tiny)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds after which remaining items are skipped")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    p.add_argument("--out", default=str(common.RESULTS))
    args = p.parse_args()
    unknown = set(args.parts) - {"steps", "layers", "peers"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    args.backend = args.backend or ("reference" if args.tiny else "pallas")
    args.grid = TINY_GRID if args.tiny else parse_grid(args.grid, STEP_GRID)
    args.layer_grid = TINY_GRID if args.tiny else parse_grid(args.layer_grid, LAYER_GRID)
    return args


def main():
    args = parse_args()
    bench = Bench(args)
    models = TINY_MODELS if args.tiny else MODELS
    print(f"{bench.result['device']} ({bench.result['backend']}), jax {jax.__version__}, backend {args.backend}, "
          f"parts {','.join(args.parts)}", flush=True)
    bench.result |= {"backend_kernels": args.backend, "parts": args.parts, "rows": args.rows, "steps_per_call": STEPS,
                     "lai_commit": lai_commit(),
                     "assumptions": ["NSA-1B ffn 8192 (intermediate_size) assumed",
                                     "8B NSA shape: Qwen3-8B sizes with 32/2 heads, head_dim 128, llama-nsa (no qk-norm), "
                                     "untied embeddings",
                                     "Lai: kernel_size = kernel_stride = block_size, init_blocks 0, local_blocks 1",
                                     "step floors count the weights in full and S selected blocks per layer and row "
                                     "(the union over T rows is at least S)"]}
    bench.result["models"] = {name: describe(models[name]) for name in args.models}
    bench.result["rates"] = common.measure_rates(args.tiny)
    bench.save()
    for name in args.models:  # per model: the small per-layer items first, then the full steps
        if {"layers", "peers"} & set(args.parts):
            layers_part(bench, name, models[name], args.layer_grid, args.rows, args.backend, args.parts)
        if "steps" in args.parts:
            steps_part(bench, name, models[name], args.grid, args.rows, args.backend)
    bench.result["total_s"] = bench.elapsed()
    bench.save()
    print(f"\nerrors: {len(bench.result['errors'])}; skipped: {len(bench.result['skipped'])}; "
          f"{bench.elapsed():.0f} s; JSON: {bench.path}")
    for note in bench.result["notes"]:
        print(f"note: {note}")
    print()
    print(markdown(bench.result))


if __name__ == "__main__":
    main()
