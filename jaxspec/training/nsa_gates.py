"""Fitting the gates of an NSA model made from a dense Llama (`models.nsa_convert`), and the gate file.

NSA adds only the gate projection `g_proj` [3 Hq, D] per layer to the dense weights; it is fitted by
distillation: with everything else frozen, the gates minimise KL(dense || NSA) of the next-token
distributions on real text (`training.data`'s split of `jaxspec.corpus`, whose held-out documents
are never trained on).

    fit_gates(cfg, dense_params, batches, steps, lr) -> g_proj  Adam on the gates only, init 0
    kl_divergence(cfg, dense_params, g_proj, tokens) -> float   the loss, e.g. on held-out text
    save_gates / load_gates                                     the small gate file that ships in the repo

The NSA model's logits (`nsa_logits`) come from the decoder's own layers without a KV cache
(`decoder.sequence_forward`), with NSA attention computed as masked dense attention
(`nsa_attention`: matrix products, which differentiate cheaply, instead of the cache path's
gathers), each layer rematerialised in the backward pass: a 2048-token row needs a few GB, whatever
the number of layers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import files
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder
from jaxspec.models.config import ModelConfig, NSAConfig, nsa_hf_keys
from jaxspec.models.kvcache import cache_slots
from jaxspec.models.nsa_convert import DEFAULT_NSA, check_dense_llama, gate_shape, to_nsa
from pallas_kernels._common import matmul_precision
from pallas_kernels.nsa_compressed import nsa_compressed_rows, select_blocks

Params = decoder.Params

REPO = Path(__file__).resolve().parents[2]
SHIPPED_GATES = REPO / "checkpoints" / "nsa_smollm2_gates.safetensors"
GATES_FILE = "nsa_gates.safetensors"  # the gates, beside the weights in every converted checkpoint
GATE_TENSOR = "g_proj"
GATES_FORMAT = "jaxspec-nsa-gates/1"


# ---------------------------------------------------------------------------------------------------
# The fit's forward: NSA logits without a cache


def nsa_attention(q, k, v, gates, nsa_cfg: NSAConfig, scale: float):
    """NSA attention of a whole sequence at positions 0..T-1: q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh]
    (post-RoPE), gates [B, T, Hq, 3] after the sigmoid. Same semantics as `jaxspec.models.nsa` over a
    cache holding these keys (the compressed branch and the block selection are the kernels'
    references); the selected and window branches are masked [T, T] attention. Returns [B, T, Hq, Dh]."""
    B, T, Hq, Dh = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs = nsa_cfg.block_size
    S = cache_slots(T)  # the decoder's cache length: the same compressed blocks, the same selection
    NB = S // bs
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    precision = matmul_precision(q.dtype)

    def pooled(x):  # [B, T, Hkv, Dh] -> [B, Hkv, NB, Dh]: block means, the rows' view of the cache's k_cmp / v_cmp
        xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, S - T), (0, 0), (0, 0)))
        return jnp.mean(xp.reshape(B, NB, bs, Hkv, Dh), axis=2).astype(x.dtype).transpose(0, 2, 1, 3)

    o_cmp, weights = nsa_compressed_rows(q, pooled(k), pooled(v), pos, block_size=bs, scale=scale)
    idx = select_blocks(jax.lax.stop_gradient(weights), pos, block_size=bs, block_counts=nsa_cfg.block_counts,
                        rule=nsa_cfg.topk_rule)  # [B, T, Hkv, block_counts], -1: none
    chosen = jnp.any(idx[..., None] == jnp.arange(NB, dtype=jnp.int32), axis=-2)  # [B, T, Hkv, NB]
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    causal = s <= t
    selected = jnp.repeat(chosen, bs, axis=-1)[..., :T] & causal[:, None, :]  # [B, T, Hkv, T]
    window = causal & (s > t - nsa_cfg.window_size)  # [T, T]

    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dh)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, kf, precision=precision) * scale  # [B, Hkv, G, T, T]

    def branch(mask):  # mask broadcastable to [B, Hkv, 1, T, T]
        masked = jnp.where(mask, logits, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
        p = jnp.exp(masked - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        return jnp.einsum("bkgts,bskd->btkgd", p, vf, precision=precision)

    o_slc = branch(jnp.transpose(selected, (0, 2, 1, 3))[:, :, None])
    o_swa = branch(window) if nsa_cfg.window_size else jnp.zeros_like(o_slc)
    g = gates.astype(jnp.float32).reshape(B, T, Hkv, G, 3)
    out = g[..., 0:1] * o_cmp.astype(jnp.float32).reshape(B, T, Hkv, G, Dh) + g[..., 1:2] * o_slc + g[..., 2:3] * o_swa
    return out.reshape(B, T, Hq, Dh).astype(q.dtype)


def nsa_logits(params: Params, cfg: ModelConfig, tokens: jax.Array, remat: bool = True) -> jax.Array:
    """Teacher-forced float32 logits [B, T, V] of the NSA model `cfg` over `tokens` [B, T] from
    position 0: `decoder.score`'s function, computed by `decoder.sequence_forward` with
    `nsa_attention` (each layer rematerialised in the backward pass when `remat`)."""
    if cfg.nsa is None:
        raise JaxspecError("nsa_logits needs an NSA model config")
    attend = functools.partial(nsa_attention, nsa_cfg=cfg.nsa, scale=cfg.head_dim**-0.5)
    return decoder.logits(params, cfg, decoder.sequence_forward(params, cfg, tokens, attend, remat=remat))


# ---------------------------------------------------------------------------------------------------
# Fitting the gates


def kl_from_logits(teacher_logp: jax.Array, student_logits: jax.Array) -> jax.Array:
    """Mean over positions of KL(teacher || student); teacher as log-probabilities [..., V]."""
    student_logp = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1))


def _kl(g_proj, dense_params, tokens, *, cfg, nsa_cfg, remat):
    teacher = jax.lax.stop_gradient(jax.nn.log_softmax(decoder.score(dense_params, cfg, tokens), axis=-1))
    nsa_cfg_model, nsa_params = to_nsa(cfg, dense_params, nsa_cfg, g_proj)
    return kl_from_logits(teacher, nsa_logits(nsa_params, nsa_cfg_model, tokens, remat=remat))


def kl_divergence(cfg: ModelConfig, dense_params: Params, g_proj, tokens, nsa_cfg: NSAConfig = DEFAULT_NSA) -> float:
    """Mean KL(dense || NSA with gates g_proj) of the next-token distributions over `tokens` [B, T]
    (one row at a time)."""
    fn = _kl_fn(cfg, nsa_cfg)
    g = jnp.asarray(g_proj, jnp.float32)
    rows = np.asarray(tokens, np.int32)
    return float(np.mean([fn(g, dense_params, jnp.asarray(row[None])) for row in rows]))


@functools.lru_cache(maxsize=None)
def _kl_fn(cfg: ModelConfig, nsa_cfg: NSAConfig):
    return jax.jit(functools.partial(_kl, cfg=cfg, nsa_cfg=nsa_cfg, remat=False))


@functools.lru_cache(maxsize=None)
def make_step(cfg: ModelConfig, nsa_cfg: NSAConfig, lr: float, micro_batch: int):
    """(optimizer, step): Adam at `lr` and step(g_proj, opt_state, dense_params, tokens [B, T]) ->
    (g_proj, opt_state, mean KL), jitted: gradients of micro-batches of `micro_batch` rows are
    averaged, then one optimizer update."""
    import optax

    optimizer = optax.adam(lr)
    grad_fn = jax.value_and_grad(lambda g, p, t: _kl(g, p, t, cfg=cfg, nsa_cfg=nsa_cfg, remat=True))

    def step(g, opt_state, dense_params, tokens):
        B, T = tokens.shape
        micro = tokens.reshape(B // micro_batch, micro_batch, T)

        def accumulate(carry, rows):
            loss, grad = grad_fn(g, dense_params, rows)
            return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grad)), None

        (loss, grad), _ = jax.lax.scan(accumulate, (jnp.float32(0), jnp.zeros_like(g)), micro)
        n = micro.shape[0]
        updates, opt_state = optimizer.update(grad / n, opt_state, g)
        return optax.apply_updates(g, updates), opt_state, loss / n

    return optimizer, jax.jit(step, donate_argnums=(0, 1))


def fit_gates(
    cfg: ModelConfig,
    dense_params: Params,
    token_batches: Iterable,
    steps: int,
    lr: float = 3e-3,
    *,
    nsa_cfg: NSAConfig = DEFAULT_NSA,
    micro_batch: int = 1,
    init=None,
    log_every: int = 25,
    log: Callable[[str], None] | None = print,
    history: list | None = None,
) -> np.ndarray:
    """Fits the gate projections of the NSA version of the dense model (`cfg`, `dense_params`) and
    returns g_proj float32 [L, 3 Hq, D] (HF layout).

    Only the gates train (from `init`, default 0: every gate 0.5): Adam at `lr`, one step per batch
    [B, T] of `token_batches` (B a multiple of `micro_batch`), loss the mean KL(dense || NSA) of the
    next-token distributions, the dense targets computed without gradients. Every `log_every` steps
    `log` gets a line with the mean loss since the last one and the time; `history` (if given)
    receives each step's loss.
    """
    check_dense_llama(cfg)
    if steps < 1:
        raise JaxspecError(f"the fit needs at least 1 step, got {steps}")
    optimizer, step_fn = make_step(cfg, nsa_cfg, float(lr), micro_batch)
    g = jnp.zeros(gate_shape(cfg), jnp.float32) if init is None else jnp.array(init, jnp.float32)  # a copy: g is donated
    if g.shape != gate_shape(cfg):
        raise JaxspecError(f"initial g_proj has shape {list(g.shape)}, the model needs {list(gate_shape(cfg))}")
    opt_state = optimizer.init(g)
    batches = iter(token_batches)
    start = last = time.perf_counter()
    since: list[float] = []
    for i in range(1, steps + 1):
        tokens = jnp.asarray(next(batches), jnp.int32)
        if tokens.shape[0] % micro_batch:
            raise JaxspecError(f"batch of {tokens.shape[0]} rows is not a multiple of the micro-batch {micro_batch}")
        g, opt_state, loss = step_fn(g, opt_state, dense_params, tokens)
        loss = float(loss)
        if not np.isfinite(loss):
            raise JaxspecError(f"the gate fit diverged at step {i} (loss {loss}); lower the learning rate")
        since.append(loss)
        if history is not None:
            history.append(loss)
        now = time.perf_counter()
        if log and (i == 1 or i % log_every == 0 or i == steps):
            what = "first step, compile included" if i == 1 else f"mean of {len(since)}"
            per_step = (now - last) / len(since)
            log(f"step {i}/{steps}  KL {np.mean(since):.4f} ({what})  {per_step:.2f} s/step  {now - start:.0f} s")
            since, last = [], now
        elif i == 1:
            since, last = [], now
    return np.asarray(g, np.float32)


# ---------------------------------------------------------------------------------------------------
# The gate file: g_proj and the record of its fit


def save_gates(path: Path, g_proj, metadata: dict) -> None:
    """Writes g_proj (float32 [L, 3 Hq, D]) and `metadata` (JSON) to a safetensors file, atomically."""
    from safetensors.numpy import save_file

    meta = {"format": GATES_FORMAT, "jaxspec": json.dumps(metadata, sort_keys=True, default=str)}
    tensors = {GATE_TENSOR: np.ascontiguousarray(np.asarray(g_proj, np.float32))}
    files.write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def load_gates(path: Path, cfg: ModelConfig | None = None, nsa_cfg: NSAConfig | None = None) -> tuple[np.ndarray, dict]:
    """(g_proj float32, metadata) of a gate file, checked against the dense model `cfg` and the NSA
    settings `nsa_cfg` it is meant for (when given)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise JaxspecError(f"gate file {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != GATES_FORMAT or GATE_TENSOR not in f.keys():
                raise JaxspecError(f"{path} is not a jaxspec NSA gate file")
            g = f.get_tensor(GATE_TENSOR).astype(np.float32)
        info = json.loads(meta.get("jaxspec", "{}"))
    except (SafetensorError, OSError, ValueError) as e:
        raise JaxspecError(f"cannot read gate file {path}: {e}") from None
    if cfg is not None and tuple(g.shape) != gate_shape(cfg):
        raise JaxspecError(
            f"gate file {path} holds g_proj {list(g.shape)}, this model needs {list(gate_shape(cfg))} "
            "(fit gates for it with --fit-steps N)"
        )
    if nsa_cfg is not None and info.get("nsa") and info["nsa"] != nsa_hf_keys(nsa_cfg):
        raise JaxspecError(
            f"gate file {path} was fitted for NSA {info['nsa']}, not {nsa_hf_keys(nsa_cfg)} (refit with --fit-steps N)"
        )
    return g, info


def model_fingerprint(params: Params) -> str:
    """A short hash of the dense model's embedding matrix (float32): which weights gates were fitted to."""
    return hashlib.sha256(np.asarray(params["embed"], np.float32).tobytes()).hexdigest()[:16]
