"""Lowers every Pallas kernel for CUDA on this (GPU-less) machine, at the real Qwen3-8B shapes.

The Pallas -> Triton IR lowering rejects what Triton cannot take (shapes that are not powers of
two, unsupported ops, bad indexers). Where the `triton` package is installed (torch's CUDA build
brings it), the captured Triton IR is also compiled for sm_90 and run through ptxas: the kernel
must fit in an H100's shared memory and must not spill registers. That Triton is not the one
built into jaxlib, so this is a close check, not the final word (bench/kernels.py on a GPU is).
Also checks the backend switch.
"""
import importlib.util
import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax._src.pallas.triton import pallas_call_registration
from jax.sharding import AbstractDevice, AbstractMesh

import pallas_kernels
from jaxspec.decoding.tree import TreeShape
from pallas_kernels import Collect, TreeMask
from pallas_kernels import moe, mxfp4
from pallas_kernels.moe import moe_experts_pallas
from pallas_kernels.mxfp4 import MXFP4
from pallas_kernels.quest_pages import quest_pages_pallas
from pallas_kernels._common import merge_splits_pallas
from pallas_kernels.residual_norm import residual_norm_pallas
from pallas_kernels.rope_write import rope_write_pallas
from pallas_kernels.router import route_pallas
from pallas_kernels.row_matmul import row_matmul_pallas
from pallas_kernels.sparse_attention import sparse_attention_pallas
from pallas_kernels.top_p import top_p_threshold_pallas
from pallas_kernels.topk import select_topk_pallas
from pallas_kernels.verify_attention import verify_attention_pallas
from slow_cases import slow_at

H100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"))
L, B, S = 36, 4, 32768
PAGE = 128  # paging.DEFAULT_PAGE_SIZE; pools of B * S slots plus the null page


H100_MAX_SHARED = 227 * 1024
HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def check_cuda(monkeypatch, tmp_path):
    """Returns check(f, *args): lower f for CUDA, then compile each kernel's Triton IR for sm_90."""
    modules = []
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", capture)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))

    def check(f, *args):
        with jax.sharding.use_abstract_mesh(H100):
            exported = export.export(
                jax.jit(f), platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(*args)
        configs = re.findall(r"num_stages = (\d+) : i32, num_warps = (\d+) : i32",
                             exported.mlir_module())
        assert modules and len(configs) == len(modules)
        if not HAVE_TRITON:
            return None
        return [compile_for_sm90(ir_text, int(warps), int(stages), tmp_path / f"kernel{i}")
                for i, (ir_text, (stages, warps)) in enumerate(zip(modules, configs))]

    return check


def compile_for_sm90(ir_text, num_warps, num_stages, path: Path) -> int:
    """Compiles for sm_90 and runs ptxas: fits in shared memory, no spills. Returns the shared memory bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    path.with_suffix(".ttir").write_text(ir_text)
    kernel = triton.compile(str(path.with_suffix(".ttir")), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    assert kernel.metadata.shared <= H100_MAX_SHARED, f"shared memory {kernel.metadata.shared}"
    path.with_suffix(".ptx").write_text(kernel.asm["ptx"])
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    report = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(path.with_suffix(".ptx")),
                             "-o", str(path.with_suffix(".cubin"))],
                            capture_output=True, text=True, check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and not any(spills), report
    return kernel.metadata.shared


def spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def kv_pools(Hkv, Dh):
    """Specs of the k/v pools [L, Hkv, N, Dh] holding B rows of S slots (and the null page) and of
    their page table [B, R]."""
    pool = spec((L, Hkv, B * S + PAGE, Dh), jnp.bfloat16)
    return pool, pool, spec((B, S // PAGE))


@pytest.mark.parametrize("Hq, Hkv, Dh, T, collect", [
    (32, 8, 128, 1, None),
    (32, 8, 128, 10, Collect((0, 9), "weight", True)),
    pytest.param(32, 8, 128, 10, Collect((0, 9), "logit", True), marks=pytest.mark.slow),  # 3 slow: tiles
    (32, 8, 128, 16, Collect(tuple(range(16)), "logit", False)),                            # of the others
    pytest.param(32, 8, 128, 7, Collect(tuple(range(7)), "weight", False), marks=pytest.mark.slow),
    (40, 8, 64, 16, Collect((0, 15), "weight", True)),    # G=5: 80 rows -> 128-row tile
    (32, 8, 128, 64, Collect(tuple(range(64)), "weight", False)),  # 4 row blocks, 64 collected each
    pytest.param(32, 8, 128, 64, Collect((0, 63), "logit", False), marks=pytest.mark.slow),
    (9, 3, 64, 64, Collect((0, 63), "weight", True)),     # SmolLM2, G=3: 48 rows of a 64-row tile
])
def test_verify_attention_lowers(check_cuda, Hq, Hkv, Dh, T, collect):
    check_cuda(lambda *a: verify_attention_pallas(*a, page_size=PAGE, scale=Dh ** -0.5, collect=collect),
                   spec((B, T, Hq, Dh), jnp.bfloat16), *kv_pools(Hkv, Dh), spec(()), spec((B, T)))


@pytest.mark.skipif(not HAVE_TRITON, reason="needs the triton package to compile for sm_90")
def test_paged_verify_keeps_two_key_blocks_in_flight(check_cuda):
    """Qwen3-8B decode through the page table: the pipeliner puts the table read two stages ahead of the
    key and value loads, so at three stages only one 64-key block of each was in flight (38.9 KB of shared
    memory; a paged plain step took 1.11x the contiguous one at 1 x 32K on the H200). PAGED_STAGES must
    keep two of each (2 x 2 x 64 x 128 bf16 = 64 KB)."""
    shared = check_cuda(lambda *a: verify_attention_pallas(*a, page_size=PAGE, scale=128 ** -0.5),
                        spec((B, 1, 32, 128), jnp.bfloat16), *kv_pools(8, 128), spec(()), spec((B, 1)))
    assert shared[0] >= 2 * 2 * 64 * 128 * 2, shared


@pytest.mark.parametrize("shape", [(3, 2, 1), (2, 2, 2, 2, 2)])
def test_tree_verify_attention_lowers(check_cuda, shape):
    """The two-word ancestor-bit mask: a (3, 2, 1) tree (16 rows, one 64-row tile) and a 5-deep
    binary tree (63 rows, 4 row blocks)."""
    tree = TreeShape(shape, "dfs")
    check_cuda(lambda q, k, v, pages, layer, pos, first: verify_attention_pallas(
                   q, k, v, pages, layer, pos, page_size=PAGE, scale=128 ** -0.5,
                   collect=Collect((0, tree.rows - 1), "weight", True), tree=TreeMask(first, tree.ancestors)),
               spec((B, tree.rows, 32, 128), jnp.bfloat16), *kv_pools(8, 128), spec(()),
               spec((B, tree.rows)), spec((B,)))


@pytest.mark.parametrize("shape", [None, (2, 2, 2, 2, 2)])
def test_verify_attention_with_sinks_and_window_lowers(check_cuda, shape):
    """gpt-oss's options: sinks [L, Hq] and lower bounds [B, T], with vegas's collection (rows 0 and
    last) on 10 rows and on a 5-deep binary tree (63 rows, 4 row blocks)."""
    tree = None if shape is None else TreeShape(shape, "dfs")
    T = 10 if tree is None else tree.rows
    check_cuda(lambda q, k, v, pages, layer, pos, sinks, lo, first: verify_attention_pallas(
                   q, k, v, pages, layer, pos, page_size=PAGE, scale=64 ** -0.5,
                   collect=Collect((0, T - 1), "weight", True),
                   tree=None if tree is None else TreeMask(first, tree.ancestors), sinks=sinks, lo=lo),
               spec((B, T, 64, 64), jnp.bfloat16), *kv_pools(8, 64), spec(()), spec((B, T)),
               spec((L, 64), jnp.bfloat16), spec((B, T)), spec((B,)))


@pytest.mark.parametrize("Hs", [1, 8])
def test_sparse_attention_lowers(check_cuda, Hs):
    check_cuda(lambda *a: sparse_attention_pallas(*a, page_size=PAGE, scale=128 ** -0.5, tail_capacity=16),
                   spec((B, 1, 32, 128), jnp.bfloat16), *kv_pools(8, 128), spec(()), spec((B, Hs, 2294)),
                   spec((B,)), spec((B,)), spec((B, 1)))


@pytest.mark.parametrize("Hq, Hkv, Dh, Hs", [(32, 8, 128, 1), (32, 8, 128, 8), (9, 3, 64, 1)])
def test_tree_sparse_attention_lowers(check_cuda, Hq, Hkv, Dh, Hs):
    """The deepest 32 rows of a 5-deep binary tree drafted in one step (ancestors [32, 63]): two row
    blocks for Qwen3-8B (G=4) and SmolLM2 (G=3)."""
    tree = TreeShape((2, 2, 2, 2, 2), "bfs")
    rows = np.flatnonzero(tree.node_depth == 5)
    check_cuda(lambda q, k, v, pages, layer, idx, n_idx, tail_start, q_slot, first: sparse_attention_pallas(
                   q, k, v, pages, layer, idx, n_idx, tail_start, q_slot, page_size=PAGE, scale=Dh ** -0.5,
                   tail_capacity=80, tree=TreeMask(first, tree.ancestors[rows])),
               spec((B, len(rows), Hq, Dh), jnp.bfloat16), *kv_pools(Hkv, Dh), spec(()), spec((B, Hs, 2294)),
               spec((B,)), spec((B,)), spec((B, len(rows))), spec((B,)))


def test_tree_sparse_attention_with_sinks_and_window_lowers(check_cuda):
    """gpt-oss's options on the deepest 32 rows of a 5-deep binary tree (two row blocks, G=8)."""
    tree = TreeShape((2, 2, 2, 2, 2), "bfs")
    rows = np.flatnonzero(tree.node_depth == 5)
    check_cuda(lambda q, k, v, pages, layer, idx, n_idx, tail_start, q_slot, first, sinks, lo: sparse_attention_pallas(
                   q, k, v, pages, layer, idx, n_idx, tail_start, q_slot, page_size=PAGE, scale=64 ** -0.5,
                   tail_capacity=80, tree=TreeMask(first, tree.ancestors[rows]), sinks=sinks, lo=lo),
               spec((B, len(rows), 64, 64), jnp.bfloat16), *kv_pools(8, 64), spec(()), spec((B, 8, 2294)),
               spec((B,)), spec((B,)), spec((B, len(rows))), spec((B,)), spec((L, 64), jnp.bfloat16),
               spec((B, len(rows))))


@pytest.mark.parametrize("Hq, Hkv, Dh, T, splits, qk_norm", [
    (32, 8, 128, 1, 1, True),    # Qwen3-8B, a draft step (an int8 product's one split)
    (32, 8, 128, 7, 4, True),    # a verification's 7 rows
    (9, 3, 64, 64, 1, False),    # SmolLM2, a prefill chunk of 64
])
def test_rope_write_lowers(check_cuda, Hq, Hkv, Dh, T, splits, qk_norm):
    N = (Hq + 2 * Hkv) * Dh
    pool = spec((L, Hkv, B * S + PAGE, Dh), jnp.bfloat16)
    norm = spec((L, Dh), jnp.bfloat16) if qk_norm else None
    inv_freq = np.linspace(1, 1e-4, Dh // 2).astype(np.float32)
    check_cuda(lambda sums, pos, slots, k, v, entry, layer, scale, bias, qn, kn: rope_write_pallas(
                   sums, pos, slots, k, v, entry, layer, inv_freq, num_heads=Hq, rope_scale=1.0, eps=1e-6,
                   scale=scale, bias=bias, q_norm=qn, k_norm=kn),
               spec((splits, max(16, B * T), N), jnp.float32), spec((B, T)), spec((B, T)), pool, pool, spec(()),
               spec(()), spec((L, N), jnp.float32), spec((L, N), jnp.bfloat16), norm, norm)


@pytest.mark.parametrize("M, D, splits, scale", [(1, 4096, 1, True), (7, 4096, 1, False), (896, 576, 4, True)])
def test_residual_norm_lowers(check_cuda, M, D, splits, scale):
    """Qwen3-8B's width at a draft step and a verification, SmolLM2's at a batch-128 verification."""
    col_scale = spec((L, D), jnp.float32) if scale else None
    check_cuda(lambda x, sums, w, entry, sc: residual_norm_pallas(x, sums, w, entry, eps=1e-6, scale=sc),
               spec((M, D), jnp.bfloat16), spec((splits, max(M, 16), D), jnp.float32 if scale else jnp.bfloat16),
               spec((L, D), jnp.bfloat16), spec(()), col_scale)


@pytest.mark.parametrize("M, K, N, kind, tiling", [
    (1, 576, 960, "exact", {}),       # SmolLM2's q/k/v at a draft step: 9 steps of 64, one a program
    (1, 2048, 2304, "exact", {}),     # a 1.2B Llama's q/k/v at a plain step: 4 splits (the epilogue's cap)
    (64, 1536, 576, "exact", {}),     # SmolLM2's down at a batch-8 verification: one 64-row block
    (128, 576, 960, "exact", dict(block_m=128, block_n=64)),  # bench/row_matmul.py's 128-row sweep tiling
    (1, 4096, 24576, "int8", {}),     # Qwen3-8B's gate/up in an int8 draft step
    (16, 12288, 4096, "int4", {}),    # Qwen3-8B's down, int4, groups of 128
])
def test_row_matmul_lowers(check_cuda, M, K, N, kind, tiling):
    values = {"exact": spec((L, K, N), jnp.bfloat16), "int8": spec((L, K, N), jnp.int8),
              "int4": spec((L, K // 2, N), jnp.int8)}[kind]
    scale = {"exact": None, "int8": spec((L, N), jnp.float32), "int4": spec((L, K // 128, N), jnp.float32)}[kind]
    check_cuda(lambda x, w, sc, layer: row_matmul_pallas(x, w, sc, layer=layer, reduce=False, **tiling),
               spec((M, K), jnp.bfloat16), values, scale, spec(()))


@pytest.mark.parametrize("T, E, D, F, k, activation, packed, form", [
    (1, 128, 2048, 768, 8, "silu", False, None),       # Qwen3-30B-A3B, a decode step: 8 slots, the fused form
    (1, 128, 2048, 768, 8, "silu", False, "split_k"),  # the same with K split
    (1, 128, 2048, 768, 8, "silu", False, "row_blocks"),  # the same as 16-row blocks of narrow columns
    (1, 32, 2880, 2880, 4, "gpt_oss", False, None),    # gpt-oss-20b, unquantized (biases), one row: split K
    (1, 32, 2880, 2880, 4, "gpt_oss", False, "fused"),  # the same row as the fused form, its steps narrowed to 64
    (128, 128, 2048, 768, 8, "silu", False, None),     # a verify pass of 128 rows: wide columns, one chunk of K
    (512, 128, 2048, 768, 8, "silu", False, None),     # a prefill chunk: 64-row blocks
    (64, 32, 2880, 2880, 4, "gpt_oss", False, None),   # gpt-oss-20b (biases), D = F = 45 x 64
    (1, 32, 2880, 2880, 4, "gpt_oss", "placed", None),  # gpt-oss-20b's released MXFP4 experts, the codes' bits placed
    (1, 32, 2880, 2880, 4, "gpt_oss", "exact", None),   # the same decoded by mxfp4.exact_values (PLACED_DECODE off)
    (1, 32, 2880, 2880, 4, "gpt_oss", "scaled_dot", "split_k"),
    (64, 32, 2880, 2880, 4, "gpt_oss", "placed", None),
    (64, 32, 2880, 2880, 4, "gpt_oss", "scaled_dot", None),  # the same through Triton's scaled dot (moe.SCALED_DOT)
    (64, 32, 2880, 2880, 4, "gpt_oss", "paired", None),  # the same through paired_weights' PTX (moe.PAIRED_DECODE)
    (64, 32, 2880, 2880, 4, "gpt_oss", "words", None),  # the experts as mxfp4.to_words words (word_weights' PTX)
    (64, 32, 2880, 2880, 4, "gpt_oss", "words2", None),  # the same with scales above 128 (two multiplies)
    (64, 32, 2880, 2880, 4, "gpt_oss", "scale_words", None),  # words with their scales four to a word (pack_scales)
    (1, 32, 2880, 2880, 4, "gpt_oss", "scale_words", None),
    (1, 32, 2880, 2880, 4, "gpt_oss", "words", None),   # a decode step's row through them: the one-row form
    (1, 32, 2880, 2880, 4, "gpt_oss", "words", "row_blocks"),    # the same row as row blocks of 16
    (1, 32, 2880, 2880, 4, "gpt_oss", "words64", "row_blocks"),  # in 64-column blocks (moe.WORD_MIN_COLUMNS)
])
def test_moe_experts_lowers(check_cuda, monkeypatch, T, E, D, F, k, activation, packed, form):
    monkeypatch.setattr(moe, "SCALED_DOT", packed == "scaled_dot")
    monkeypatch.setattr(moe, "PAIRED_DECODE", packed == "paired")
    monkeypatch.setattr(mxfp4, "PLACED_DECODE", packed != "exact")
    monkeypatch.setattr(moe, "WORD_MIN_COLUMNS", 64 if packed == "words64" else moe.WORD_MIN_COLUMNS)
    biased = activation == "gpt_oss"
    words = packed in ("words", "words2", "words64", "scale_words")
    codes = lambda K, N: spec((2, E, N, K // 8), jnp.uint32) if words else spec((2, E, N, K // 2), jnp.uint8)
    small = words and packed != "words2"
    scales = lambda K, N: (spec((2, E, N, -(-K // 128)), jnp.uint32) if packed == "scale_words"
                           else spec((2, E, N, K // 32), jnp.uint8))
    stack = lambda K, N: (MXFP4(codes(K, N), scales(K, N), small_scales=small) if packed
                          else spec((2, E, K, N), jnp.bfloat16))
    check_cuda(lambda x, ids, w, w_gate_up, w_down, layer, b_gate_up, b_down: moe_experts_pallas(
                   x, ids, w, w_gate_up, w_down, layer, b_gate_up=b_gate_up, b_down=b_down, activation=activation,
                   form=form),
               spec((T, D), jnp.bfloat16), spec((T, k)), spec((T, k), jnp.float32), stack(D, 2 * F), stack(F, D),
               spec(()), spec((2, E, 2 * F), jnp.bfloat16) if biased else None,
               spec((2, E, D), jnp.bfloat16) if biased else None)


@pytest.mark.parametrize("Hkv, splits, T, G, Dh", [(3, 43, 1, 3, 64), (3, 43, 5, 3, 64), (2, 64, 1, 16, 64),
                                                  (8, 16, 1, 4, 128)])
def test_merge_splits_lowers(check_cuda, Hkv, splits, T, G, Dh):
    """The split merge at batch 1: SmolLM2's draft step and 5-row verification, a 1.2B Llama's plain
    step, Qwen3-8B's."""
    check_cuda(lambda o, lse: merge_splits_pallas(o, lse, jnp.bfloat16, T=T, G=G),
               spec((1, Hkv, 1, splits, T * G, Dh), jnp.float32), spec((1, Hkv, 1, splits, T * G), jnp.float32))


@pytest.mark.parametrize("Lq, Bq, Hq, H, P, Dh", [  # Qwen3-8B's at batch 1: slow (the default run's 20 minutes)
    pytest.param(L, 1, 32, 8, S // 16, 128, marks=pytest.mark.slow), (30, 128, 9, 3, 496, 64)])
def test_quest_pages_lowers(check_cuda, Lq, Bq, Hq, H, P, Dh):
    """Qwen3-8B's pages at 1 x 32K, SmolLM2's at 128 x 7.9K (a masked last chunk): bound pools of the
    rows' 128-slot cache pages (8 bounds a page) and the null page's, under the page table."""
    bounds = spec((Lq, H, Bq * P + 8, Dh), jnp.bfloat16)
    check_cuda(lambda *a: quest_pages_pallas(*a, P * 7 // 100, page_size=128),
               spec((Bq, 1, Hq, Dh), jnp.bfloat16), bounds, bounds, spec((Bq, P // 8)), spec(()), spec((Bq,)),
               spec((Bq,)))


@pytest.mark.parametrize("S_", [pytest.param(S, marks=pytest.mark.slow), 4000])  # 4000: a masked last chunk; S slow
def test_select_topk_lowers(check_cuda, S_):
    check_cuda(lambda s, k: select_topk_pallas(s, S_ // 14, k),
                   spec((L, B, S_), jnp.float32), spec((L, B)))


@pytest.mark.parametrize("rows, V, dtype", [(896, 49152, jnp.float32), (128, 151936, jnp.float32),  # one row: slow
                                            (32, 49152, jnp.bfloat16), pytest.param(1, 151936, jnp.float32, marks=pytest.mark.slow)])
def test_top_p_threshold_lowers(check_cuda, rows, V, dtype):
    """SmolLM2's vocabulary at a batch-128 chain's verification rows, Qwen3's at a draft step (one
    program per row), and the split path (<= 48 rows): SmolLM2 at batch 32, Qwen3 at batch 1."""
    check_cuda(lambda x: top_p_threshold_pallas(x, 1 / 0.7, 0.95), spec((rows, V), dtype))


@pytest.mark.parametrize("rows, E, k, rule", [(1, 128, 8, "softmax_topk"), (64, 32, 4, "topk_softmax"),
                                           (7, 60, 6, "softmax_topk"), (3, 1024, 8, "softmax_topk")])
def test_moe_route_lowers(check_cuda, rows, E, k, rule):
    """Qwen3-30B-A3B's router at one row, gpt-oss-20b's at a chunk's rows with its bias stack (bf16, read at
    the layer), a width that is not a power of two, and the most experts a program holds (four warps)."""
    if rule == "topk_softmax":
        check_cuda(lambda x, b, layer: route_pallas(x, k, rule, False, b, layer), spec((rows, E), jnp.float32),
                   spec((24, E), jnp.bfloat16), spec((), jnp.int32))
    else:
        check_cuda(lambda x: route_pallas(x, k, rule, True), spec((rows, E), jnp.float32))


def test_backend_switch():
    assert pallas_kernels.BACKENDS == ("reference", "pallas")
    scores = jax.random.normal(jax.random.key(400), (2, 256))
    with pytest.raises(ValueError, match="unknown kernel backend 'triton'"):
        pallas_kernels.select_topk(scores, 8, 8, backend="triton")
    ref = pallas_kernels.select_topk(scores, 8, 8)
    got = pallas_kernels.select_topk(scores, 8, 8, backend="pallas")   # interpret mode on CPU
    np.testing.assert_array_equal(np.sort(np.asarray(got)), np.sort(np.asarray(ref)))


# NSA: NSA-1B (G 16, block 16, 128K context: 8192 compressed blocks; T 16: a 256-row tile on eight
# warps), an 8B shape (Dh 128, block 64; T 10 and 16: two row blocks per KV head), SmolLM2-NSA (G 3),
# and float32 caches (half the keys per step), up to the largest block (128).
NSA_SHAPES = [
    # (Hq, Hkv, Dh, block_size, slots, T, dtype)
    (32, 2, 64, 16, 131072, 1, jnp.bfloat16),
    (32, 2, 64, 16, 131072, 16, jnp.bfloat16),
    (32, 2, 128, 64, 131072, 10, jnp.bfloat16),
    (32, 2, 128, 64, 131072, 16, jnp.bfloat16),
    (32, 2, 128, 128, 131072, 16, jnp.bfloat16),
    (9, 3, 64, 16, 32768, 16, jnp.bfloat16),
    (9, 3, 64, 16, 32768, 1, jnp.bfloat16),
    (32, 2, 64, 16, 131072, 16, jnp.float32),
    (32, 2, 128, 128, 131072, 10, jnp.float32),
]


TREE_SHAPES = [  # a 63-row draft tree's rows (nsa_tree_compressed, nsa_grouped)
    (32, 2, 64, 16, 131072, 63, jnp.bfloat16),
    (9, 3, 64, 16, 32768, 63, jnp.bfloat16),
]


NSA_PAGE = 128  # paging.DEFAULT_PAGE_SIZE: the pools hold one row's slots and the null page


def nsa_pools(Hkv, Dh, slots, dtype, block_size=1):
    """Specs of a pool [24, Hkv, N, Dh] (compressed: N / block_size entries) and its one row's table."""
    pool = spec((24, Hkv, (slots + NSA_PAGE) // block_size, Dh), dtype)
    return pool, spec((1, slots // NSA_PAGE))


# By default each NSA kernel lowers at NSA-1B's 256-row tile, the 8B shapes' largest blocks, SmolLM2's
# one row, a float32 cache and a tree's rows; the other shapes with the slow tests (slow_at).
@pytest.mark.parametrize("Hq, Hkv, Dh, bs, slots, T, dtype", slow_at(NSA_SHAPES + TREE_SHAPES, (0, 2, 5, 8, 10)))
def test_nsa_compressed_lowers(check_cuda, Hq, Hkv, Dh, bs, slots, T, dtype):
    from pallas_kernels.nsa_compressed import nsa_compressed_pallas
    cmp, pages = nsa_pools(Hkv, Dh, slots, dtype, bs)
    check_cuda(lambda *a: nsa_compressed_pallas(*a, page_size=NSA_PAGE, block_size=bs, scale=Dh ** -0.5),
               spec((1, T, Hq, Dh), dtype), cmp, cmp, pages, spec(()), spec((1, T)))


@pytest.mark.parametrize("Hq, Hkv, Dh, bs, slots, T, dtype, group", slow_at(
    [(*shape, group) for shape in TREE_SHAPES for group in (1, 8)], (0, 3)))
def test_nsa_grouped_lowers(check_cuda, Hq, Hkv, Dh, bs, slots, T, dtype, group):
    from pallas_kernels.nsa_grouped import nsa_grouped_pallas
    tree = TreeShape((2,) * 5, "bfs")
    assert tree.rows == T
    cache, pages = nsa_pools(Hkv, Dh, slots, dtype)
    rows = spec((1, T, Hq, Dh), dtype)
    check_cuda(lambda *a: nsa_grouped_pallas(*a[:6], tree.ancestors, *a[6:], page_size=NSA_PAGE, group=group,
                                             shared=False, block_size=bs, window=512, scale=Dh ** -0.5),
               rows, cache, cache, pages, spec(()), spec((1,)), spec((1, T, Hkv, 16)), rows,
               spec((1, T, Hq, 3), dtype))


@pytest.mark.parametrize("Hq, Hkv, Dh, bs, slots, T, dtype", slow_at(NSA_SHAPES, (0, 2, 5, 8)))
def test_nsa_selected_lowers(check_cuda, Hq, Hkv, Dh, bs, slots, T, dtype):
    from pallas_kernels.nsa_selected import nsa_selected_pallas
    cache, pages = nsa_pools(Hkv, Dh, slots, dtype)
    rows = spec((1, T, Hq, Dh), dtype)
    check_cuda(lambda *a: nsa_selected_pallas(*a, page_size=NSA_PAGE, block_size=bs, window=512, scale=Dh ** -0.5),
               rows, cache, cache, pages, spec(()), spec((1, T)), spec((1, T, Hkv, 16)), rows,
               spec((1, T, Hq, 3), dtype))
