"""The weights a draft step reads: quantized copies (`--draft-weights int8|int4`) and skipped layers
(`--draft-skip`).

A self-draft step reads every weight (sparse-KV drafting removes KV reads, not weight reads), so at
batch 1 and short contexts it costs a full step. A draft can read less:
- int8 / int4: quantized copies of the layer matrices (`models.quantize`: per column int8, group-wise
  int4);
- skipped layers: the draft runs the model without some layers (their residual branches left out;
  SWIFT, Draft & Verify), chosen by `calibrate_skip` on local text.
The verify pass keeps the exact weights and every layer, and draft proposals are whatever the draft
model proposes, so exact rejection sampling keeps the output distribution the model's own; the draft
only changes acceptance. Draft KV writes are temporary (verification rewrites every tree row's KV
with the exact weights), so the cache stays exact.

The draft's own stack lives in the params pytree under "draft_layers" (`with_draft_weights`): the
quantized matrices, and with skipped layers every per-layer array of the kept layers; with
quantized weights the LM head gets a per-column int8 copy too ("draft_head", int8 for int4 drafts
as well: the head's error moves every logit). The engine's
draft step takes `draft_params(params, kind, skip, backend)`: params whose "layers" are the draft's,
and the model layer each stack entry is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, sharding
from jaxspec.models.quantize import QUANTIZERS, Quantized, int4_group, quantize_int4

DRAFT_MATRICES = decoder.MATRICES  # the layer matrices a draft step reads (in its own copies)
DRAFT_WEIGHTS = ("exact", "int8", "int4")


def kept_layers(num_layers: int, skip: tuple[int, ...]) -> np.ndarray:
    """The model layers a draft with `skip` runs, in order (int32)."""
    return np.array([i for i in range(num_layers) if i not in set(skip)], np.int32)


# Stacks the kernels read at the attended model layer (the cache's), not at the draft stack's entry:
# a draft that skips layers keeps them whole (gpt-oss's sink logits [L, Hq]).
MODEL_LAYER_STACKS = ("sinks",)


def with_draft_weights(params: dict, kind: str, skip: tuple[int, ...] = (), shards: int = 1) -> dict:
    """`params` with the draft's layer stack under "draft_layers" (exact weights, no skipped layer:
    none, unchanged). Quantized matrices are made one layer at a time (no full float32 copy);
    `shards`: tensor-parallel devices the params are split over (int4 groups of row-split matrices
    stay within one)."""
    if kind not in DRAFT_WEIGHTS:
        raise JaxspecError(f"--draft-weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {kind!r}")
    layers = params["layers"]
    num_layers = layers["attn_norm"].shape[0]
    check_skip(skip, num_layers)
    if kind == "exact" and not skip:
        return params
    kept = kept_layers(num_layers, skip)
    copied = [name for name in layers if kind == "exact" or name not in DRAFT_MATRICES]
    draft = {name: layers[name] if name in MODEL_LAYER_STACKS else layers[name][kept] for name in copied} if skip else {}
    if kind == "exact":
        return {**params, "draft_layers": draft}
    for name in DRAFT_MATRICES:
        row_blocks = shards if name in sharding.ROWS else 1  # tensor parallelism splits these by rows
        quantize = jax.jit(functools.partial(quantize_int4, shards=row_blocks) if kind == "int4" else QUANTIZERS[kind])
        per_layer = [quantize(layers[name][i]) for i in kept]
        draft[name] = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return {**params, "draft_layers": draft, "draft_head": jax.jit(QUANTIZERS["int8"])(head)}


def check_skip(skip: tuple[int, ...], num_layers: int) -> None:
    """One-line errors for skip lists the model cannot run."""
    if any(not 0 <= i < num_layers for i in skip):
        raise JaxspecError(f"--draft-skip: layer {max(skip)} does not exist (the model has layers 0..{num_layers - 1})")
    if len(set(skip)) >= num_layers:
        raise JaxspecError(f"--draft-skip skips all {num_layers} layers; a draft needs at least one")


def draft_params(params: dict, kind: str, skip: tuple[int, ...], backend: str) -> tuple[dict, np.ndarray | None]:
    """(the params a draft step reads under `--draft-weights kind --draft-skip skip`, with its
    quantized matrices and head ("lm_head", which decoder.logits prefers to the tied embeddings)
    read by the `backend` kernels; the model layer of each entry of their layer stack, or None for
    every layer)."""
    if kind == "exact" and not skip:
        return params, None
    draft = params.get("draft_layers", {})
    kept = kept_layers(params["layers"]["attn_norm"].shape[0], skip)
    if {m.bits for m in draft.values() if isinstance(m, Quantized)} != ({int(kind[3:])} if kind != "exact" else set()):
        raise JaxspecError(f"--draft-weights {kind}: the params carry no such draft copies (make them with with_draft_weights)")
    # a stack made with skipped layers holds every per-layer array; its length is all a trace can check
    made_for = draft["attn_norm"].shape[0] if "attn_norm" in draft else None
    if made_for != (len(kept) if skip else None):
        raise JaxspecError(f"--draft-skip {list(skip)}: the params' draft layers were made for another skip list")
    draft = {name: dataclasses.replace(m, backend=backend) if isinstance(m, Quantized) else m for name, m in draft.items()}
    layers = draft if skip else {**params["layers"], **draft}
    head = {} if kind == "exact" else {"lm_head": dataclasses.replace(params["draft_head"], backend=backend)}
    return {**params, "layers": layers, **head}, (kept if skip else None)


def draft_bytes(params: dict) -> int:
    """Device bytes of the draft's own stack and head (the memory --draft-weights and --draft-skip add)."""
    return sum(x.nbytes for x in jax.tree.leaves((params.get("draft_layers", {}), params.get("draft_head"))))


def parse_skip(text: str, num_layers: int) -> tuple[int, ...]:
    """`--draft-skip` layers: "3,5,10-12" (layers and inclusive ranges) or "everyN" (every N-th layer
    from layer N - 1: 1, 3, 5, ... for every2; the last layer is kept)."""
    try:
        if text.startswith("every"):
            n = int(text[5:])
            if n < 2:
                raise ValueError
            skip = tuple(i for i in range(n - 1, num_layers - 1, n))
        else:
            skip = set()
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                if int(hi or lo) < int(lo):  # a range runs upwards
                    raise ValueError
                skip.update(range(int(lo), int(hi or lo) + 1))
            skip = tuple(sorted(skip))
    except ValueError:
        raise JaxspecError(f"--draft-skip takes layers and ranges (3,5,10-12), everyN (N >= 2), calibrated or a "
                           f"calibration file, got {text!r}") from None
    check_skip(skip, num_layers)
    return skip


def calibrate_skip(params: dict, cfg, tokens: jax.Array, kind: str, min_acceptance: float, log=print) -> dict:
    """The layers a draft can skip while its acceptance stays >= min_acceptance (SWIFT / Draft &
    Verify style, greedy, teacher-forced on local text `tokens` [B, T]).

    Acceptance is the exact rejection-sampling acceptance of one token at temperature 1, the mean over
    positions of sum_v min(p_v, q_v) (p the model's next-token distribution, q the draft's: `kind`
    weights, the candidate layers skipped). Every layer is first tried alone; then layers join the
    skip list least harmful first while the acceptance stays above the bound. 2L forwards; one
    compilation per skip count."""
    num_layers = cfg.num_layers
    draft = draft_params(with_draft_weights(params, kind), kind, (), "reference")[0]
    p = jax.nn.softmax(decoder.score(params, cfg, tokens), axis=-1)

    @jax.jit
    def acceptance(kept):
        layers = jax.tree.map(lambda a: a[kept], draft["layers"])
        q = jax.nn.softmax(decoder.score({**draft, "layers": layers}, cfg, tokens, layer_ids=kept), axis=-1)
        return jnp.mean(jnp.sum(jnp.minimum(p, q), axis=-1))

    def without(skip):
        return float(acceptance(jnp.asarray(kept_layers(num_layers, tuple(skip)))))

    exact_draft = without(())
    alone = [without((i,)) for i in range(num_layers)]
    log(f"acceptance with every layer ({kind} weights): {exact_draft:.4f}; skipping one layer: "
        + " ".join(f"{i}:{a:.3f}" for i, a in enumerate(alone)))
    skip, trace = [], []
    for i in np.argsort(alone)[::-1]:
        if len(skip) == num_layers - 1:
            break
        a = without(sorted(skip + [int(i)]))
        if a >= min_acceptance:
            skip.append(int(i))
            trace.append({"skip": sorted(skip), "acceptance": a})
            log(f"skip {sorted(skip)}: acceptance {a:.4f}")
    return {"skip": sorted(skip), "acceptance": trace[-1]["acceptance"] if trace else exact_draft,
            "acceptance_all_layers": exact_draft, "acceptance_skipping_one": alone, "trace": trace,
            "draft_weights": kind, "min_acceptance": min_acceptance, "tokens": list(tokens.shape)}


def read_bytes(cfg, weight_bytes: int, kind: str, skip: tuple[int, ...] = ()) -> int:
    """The weight bytes one draft forward reads (the planner's cost model, benchmark floors): the
    model's `weight_bytes` without the skipped layers, with the kept layers' matrices at `kind`'s size
    (int8: a byte and a column scale; int4: half a byte and a scale per group and column) and, for
    quantized kinds, the head in int8."""
    shapes = decoder.param_shapes(cfg)["layers"]
    itemsize = jnp.dtype(cfg.dtype).itemsize
    per_layer = sum(int(np.prod(shape[1:])) for shape in shapes.values()) * itemsize
    kept = cfg.num_layers - len(skip)
    total = weight_bytes - len(skip) * per_layer
    if kind == "exact":
        return total
    for name in DRAFT_MATRICES:
        _, K, N = shapes[name]
        quantized = K * N + 4 * N if kind == "int8" else K * N // 2 + 4 * (K // int4_group(K)) * N
        total += kept * (quantized - K * N * itemsize)
    V, D = cfg.vocab_size, cfg.hidden_size
    return total + (V * D + 4 * V) - V * D * itemsize  # the head, int8 (an embedding gather reads one row)
