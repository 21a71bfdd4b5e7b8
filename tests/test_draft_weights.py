"""Draft models (`--draft-weights int8|int4`, `--draft-skip`; models.quantize, models.draft_weights,
pallas_kernels/row_matmul.py): the quantize round trips stay within half a step, the row kernel equals
the float64 product of the exact or dequantized matrix, small exact matrices run it in place, the draft forward reads the copies and leaves out the
skipped layers, calibration keeps its bound, and bad specs are one-line errors. That drafts with
these models keep the output exactly the model's is tested with every other drafter in
tests/test_engine.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as kernels
from jaxspec.calibrate_skip import resolve_skip
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, draft_weights, quantize
from jaxspec.models.config import ModelConfig
from pallas_kernels.row_matmul import epilogue_splits, pack_int4, row_matmul_pallas, unpack_int4

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, qk_norm=True, dtype="float32")


def scaled_columns(key, shape):
    """Normal weights whose columns differ in scale by 400x, with one zero column."""
    w = jax.random.normal(key, shape) * jnp.linspace(0.01, 4.0, shape[-1])
    return w.at[..., 7].set(0.0)


def test_int8_round_trip_within_half_a_step():
    w = scaled_columns(jax.random.key(0), (3, 96, 40))
    q = quantize.quantize_int8(w)
    assert q.bits == 8 and q.values.dtype == jnp.int8 and q.scale.shape == (3, 40)
    error = np.abs(np.asarray(quantize.dequantize(q), np.float64) - np.asarray(w, np.float64))
    assert (error <= np.asarray(q.scale)[:, None, :] / 2 + 1e-7).all()
    assert np.abs(np.asarray(q.values)).max() == 127 and (np.asarray(q.values)[:, :, 7] == 0).all()


@pytest.mark.parametrize("K, group", [(256, 128), (192, 64), (96, 32)])
def test_int4_round_trip_within_half_a_step(K, group):
    w = scaled_columns(jax.random.key(K), (2, K, 48))
    q = quantize.quantize_int4(w)
    assert q.bits == 4 and q.values.shape == (2, K // 2, 48) and q.scale.shape == (2, K // group, 48)
    error = np.abs(np.asarray(quantize.dequantize(q), np.float64) - np.asarray(w, np.float64))
    step = np.repeat(np.asarray(q.scale), group, axis=1)  # each row's group scale
    assert (error <= step / 2 + 1e-6).all()
    values = np.asarray(jax.vmap(lambda v: unpack_int4(v, K // group))(q.values))
    assert values.min() == -7 and values.max() == 7


def test_int4_packing_is_invertible():
    values = jax.random.randint(jax.random.key(1), (128, 24), -8, 8, jnp.int8)
    packed = pack_int4(values, 2)
    assert packed.shape == (64, 24) and packed.dtype == jnp.int8
    np.testing.assert_array_equal(unpack_int4(packed, 2), values)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("M", [1, 5, 37, 70])
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_row_matmul_equals_the_float64_product(bits, M, backend):
    """Fresh random rows times a stacked matrix (exact float32: bits 16, or quantized) at a layer index,
    against float64; M = 1 leaves 15 rows of a 16-row block past x's end, which the kernel must read as
    zeros and not store; M = 37 leaves 27 of a 64-row block, M = 70 spans two."""
    L, K, N = 3, 256, 192
    w = scaled_columns(jax.random.key(M + bits), (L, K, N))
    if bits == 16:
        values, scale, dense = w, None, w
    else:
        q = (quantize.quantize_int8 if bits == 8 else quantize.quantize_int4)(w)
        values, scale, dense = q.values, q.scale, quantize.dequantize(q)
    x = jax.random.normal(jax.random.key(100 + M), (M, K))
    if backend == "pallas":
        assert kernels.row_matmul_supported(values[0], None if scale is None else scale[0])
    got = kernels.row_matmul(x, values, scale, jnp.float32, layer=jnp.int32(1), backend=backend)
    expected = np.asarray(x, np.float64) @ np.asarray(dense, np.float64)[1]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())


def test_row_matmul_one_block_of_many_rows():
    """bench/row_matmul.py's sweep tiling past 64 rows: 100 rows in one 128-row block of 64 columns
    (28 rows past x's end), K = 576 in 9 splits of one 64-row step, against float64."""
    L, K, N = 2, 576, 192
    w = jax.random.normal(jax.random.key(11), (L, K, N))
    x = jax.random.normal(jax.random.key(12), (100, K))
    got = row_matmul_pallas(x, w, None, jnp.float32, layer=jnp.int32(1), interpret=True, block_m=128, block_n=64)
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)[1]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())


def test_row_matmul_caps_the_splits_an_epilogue_sums():
    """An exact product's partial sums for rope_write / residual_norm come in at most EPILOGUE_BYTES a
    row: N = 1024 allows 10 splits, so K's 16 steps of 128 run 8 (the rule alone: 16), and their sum
    still equals the float64 product. int8 keeps the rule's 16."""
    L, K, N = 2, 2048, 1024
    w = jax.random.normal(jax.random.key(21), (L, K, N))
    x = jax.random.normal(jax.random.key(22), (1, K))
    assert epilogue_splits(N) == 10
    sums, scale = kernels.row_matmul_partials(x, w, None, layer=jnp.int32(1), backend="pallas")
    assert sums.shape[0] == 8 and scale is None
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)[1]
    got = np.asarray(sums, np.float64)[:, :1].sum(axis=0)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())
    q = quantize.quantize_int8(w)
    int8 = jax.eval_shape(lambda x, v, s: kernels.row_matmul_partials(x, v, s, layer=jnp.int32(1), backend="pallas"),
                          x, q.values, q.scale)
    assert int8[0].shape[0] == 16


def test_small_exact_matrices_run_the_row_kernel_in_place():
    """With the Pallas backend a decode step's few rows read small exact matrices in place through the
    row kernel (decoder.InPlace), and the forward equals the reference backend's; more rows than one
    row block, large matrices and the reference backend keep XLA's product."""
    stack = jax.ShapeDtypeStruct((3, 576, 960), jnp.bfloat16)  # SmolLM2's q/k/v
    assert kernels.row_matmul_reads_exact(stack, kernels.ROW_MATMUL_ROWS, "pallas")
    assert not kernels.row_matmul_reads_exact(stack, kernels.ROW_MATMUL_ROWS + 1, "pallas")
    assert not kernels.row_matmul_reads_exact(stack, 1, "reference")
    assert not kernels.row_matmul_reads_exact(jax.ShapeDtypeStruct((3, 4096, 6144), jnp.bfloat16), 1, "pallas")
    assert kernels.row_matmul_reads_exact(jax.ShapeDtypeStruct((3, 2048, 2304), jnp.bfloat16), 1, "pallas")  # 1.2B q/k/v
    assert not kernels.row_matmul_reads_exact(jax.ShapeDtypeStruct((3, 8192, 2048), jnp.bfloat16), 1, "pallas")  # its down
    assert kernels.row_matmul_reads_exact(jax.ShapeDtypeStruct((3, 2048, 5120), jnp.bfloat16), 1, "pallas")  # Qwen3-30B
    gpt_oss_o = jax.ShapeDtypeStruct((3, 4096, 2880), jnp.bfloat16)
    assert not kernels.row_matmul_reads_exact(gpt_oss_o, 1, "pallas")
    params = decoder.init_params(CFG, jax.random.key(6), scale=0.3)
    assert all(kernels.row_matmul_reads_exact(params["layers"][name], 24, "pallas") for name in decoder.MATRICES)
    tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, CFG.vocab_size)
    got = decoder.score(params, CFG, tokens, backend="pallas")
    expected = decoder.score(params, CFG, tokens)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(expected)).max() > 1.0


@pytest.mark.parametrize("weights, skip", [  # int8's and exact's stacks are read as int4's is: slow
    pytest.param("int8", (), marks=pytest.mark.slow), ("int4", ()), pytest.param("exact", (1,), marks=pytest.mark.slow),
    ("int4", (0, 2))])
def test_the_draft_forward_reads_its_own_stack(weights, skip):
    """decoder.score with the draft params equals the model whose matrices are the dequantized copies
    and whose skipped layers are gone (a model of the kept layers), and differs from the exact model."""
    params = decoder.init_params(CFG, jax.random.key(2), scale=0.3)
    with_copies = draft_weights.with_draft_weights(params, weights, skip)
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, CFG.vocab_size)
    draft, layer_ids = draft_weights.draft_params(with_copies, weights, skip, "pallas")
    got = decoder.score(draft, CFG, tokens, layer_ids=layer_ids)
    kept = draft_weights.kept_layers(CFG.num_layers, skip)
    layers = {name: a[kept] for name, a in params["layers"].items()}
    head = {}
    if weights != "exact":
        assert all(draft["layers"][name].backend == "pallas" for name in draft_weights.DRAFT_MATRICES)
        layers.update({name: quantize.dequantize(draft["layers"][name]) for name in draft_weights.DRAFT_MATRICES})
        assert draft["lm_head"].bits == 8 and draft["lm_head"].backend == "pallas"
        head = {"lm_head": quantize.dequantize(draft["lm_head"])}
    reference_cfg = CFG.replace(num_layers=len(kept))
    expected = decoder.score({**params, "layers": layers, **head}, reference_cfg, tokens)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(got) - np.asarray(decoder.score(params, CFG, tokens))).max() > 1e-3
    copies = [with_copies[name] for name in ("draft_layers", "draft_head") if name in with_copies]
    assert draft_weights.draft_bytes(with_copies) == sum(x.nbytes for x in jax.tree.leaves(copies))
    read = sum(x.nbytes for name, tree in draft.items() if not name.startswith("draft_") for x in jax.tree.leaves(tree))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert draft_weights.read_bytes(CFG, weight_bytes, weights, skip) == read  # the cost model's bytes
    if weights != "exact":  # quantized copies are smaller than the matrices they copy
        exact = sum(params["layers"][name][kept].nbytes for name in draft_weights.DRAFT_MATRICES)
        quantized = sum(x.nbytes for name in draft_weights.DRAFT_MATRICES for x in jax.tree.leaves(draft["layers"][name]))
        assert quantized < exact / (3 if weights == "int8" else 5)


def test_calibration_keeps_its_bound():
    """Every accepted skip list keeps the bound, the lists grow one layer at a time, and the final
    list's acceptance is what a draft with it measures."""
    params = decoder.init_params(CFG, jax.random.key(4), scale=0.15)
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, CFG.vocab_size)
    result = draft_weights.calibrate_skip(params, CFG, tokens, "int8", 0.5, log=lambda _: None)
    assert result["skip"] and len(result["skip"]) < CFG.num_layers
    assert [len(t["skip"]) for t in result["trace"]] == list(range(1, len(result["skip"]) + 1))
    assert all(t["acceptance"] >= 0.5 for t in result["trace"])
    p = jax.nn.softmax(decoder.score(params, CFG, tokens), -1)
    draft, layer_ids = draft_weights.draft_params(draft_weights.with_draft_weights(params, "int8", tuple(result["skip"])),
                                                  "int8", tuple(result["skip"]), "reference")
    q = jax.nn.softmax(decoder.score(draft, CFG, tokens, layer_ids=layer_ids), -1)
    assert float(jnp.mean(jnp.sum(jnp.minimum(p, q), -1))) == pytest.approx(result["acceptance"], abs=1e-5)
    assert draft_weights.calibrate_skip(params, CFG, tokens, "exact", 1.0, log=lambda _: None)["skip"] == []


def test_skip_specs(tmp_path):
    assert draft_weights.parse_skip("3,5,10-12", 30) == (3, 5, 10, 11, 12)
    assert draft_weights.parse_skip("every2", 7) == (1, 3, 5) and draft_weights.parse_skip("every3", 9) == (2, 5)
    path = tmp_path / "skip.json"
    path.write_text(json.dumps({"skip": [2, 4]}))
    assert resolve_skip(str(path), "unused", 6) == (2, 4) and resolve_skip(None, "unused", 6) == ()


@pytest.mark.parametrize("text, fragment", [
    ("3,x", "takes layers and ranges"), ("every1", "takes layers and ranges"), ("4,31", "layer 31 does not exist"),
    ("0-29", "skips all 30 layers"),
])
def test_bad_skip_specs(text, fragment):
    with pytest.raises(JaxspecError, match=fragment):
        draft_weights.parse_skip(text, 30)


def test_bad_draft_model_specs(tmp_path):
    with pytest.raises(JaxspecError, match="--draft-weights must be one of"):
        SpecConfig(method="vegas", draft_weights="int3").validate()
    for method in ("plain", "ngram"):
        with pytest.raises(JaxspecError, match="needs a model drafter"):
            SpecConfig(method=method, draft_weights="int8").validate()
        with pytest.raises(JaxspecError, match="needs a model drafter"):
            SpecConfig(method=method, draft_skip=(1,)).validate()
    with pytest.raises(JaxspecError, match="increasing order"):
        SpecConfig(method="vegas", draft_skip=(2, 1)).validate()
    with pytest.raises(JaxspecError, match="needs a cheaper draft model"):
        SpecConfig(method="full").validate().check_model(CFG)
    with pytest.raises(JaxspecError, match="layer 3 does not exist"):
        SpecConfig(method="vegas", draft_skip=(3,)).validate().check_model(CFG)
    params = decoder.init_params(CFG, jax.random.key(6))
    with pytest.raises(JaxspecError, match="carry no such draft copies"):
        draft_weights.draft_params(params, "int8", (), "reference")
    with pytest.raises(JaxspecError, match="carry no such draft copies"):
        draft_weights.draft_params(draft_weights.with_draft_weights(params, "int8"), "int4", (), "reference")
    with pytest.raises(JaxspecError, match="made for another skip list"):
        draft_weights.draft_params(draft_weights.with_draft_weights(params, "int8", (1,)), "int8", (0, 1), "reference")
    with pytest.raises(JaxspecError, match="no calibration at"):
        resolve_skip(str(tmp_path / "missing.json"), "unused", 3)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(JaxspecError, match="is not a calibration file"):
        resolve_skip(str(tmp_path / "bad.json"), "unused", 3)


def test_calibration_command_saves_what_generate_reads(tmp_path, hf_checkpoints, capsys):
    """`python -m jaxspec.calibrate_skip` on a checkpoint writes the skip list and its acceptance, and
    `--draft-skip FILE` reads that list back."""
    from jaxspec import calibrate_skip

    out = tmp_path / "skip.json"
    calibrate_skip.main(["--model", str(hf_checkpoints["llama"]), "--tokens", "24", "--windows", "1",
                         "--min-acceptance", "0.2", "--draft-weights", "int8", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["draft_weights"] == "int8" and saved["min_acceptance"] == 0.2 and saved["tokens"] == [1, 24]
    assert all(t["acceptance"] >= 0.2 for t in saved["trace"])
    num_layers = len(saved["acceptance_skipping_one"])
    assert resolve_skip(str(out), "unused", num_layers) == tuple(saved["skip"])
    assert f"saved {out}" in capsys.readouterr().out
