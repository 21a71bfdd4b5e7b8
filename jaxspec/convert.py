"""`python -m jaxspec.convert SRC DST [--dtype bfloat16|float32] [--force]`: any model -> jaxspec checkpoint.

    python -m jaxspec.convert SRC DST --to-nsa [--gates PATH | --fit-steps N [--fit-tokens T]
        [--fit-batch B] [--fit-micro-batch M] [--lr LR] [--seed S] [--gates-out PATH]] [--block-size 16]
        [--block-counts 16] [--window-size 128] [--topk-rule exact] [--calibrate-reuse KL [--calibrate-tokens T]]

The first form writes a jaxspec (orbax) checkpoint. `--to-nsa` instead writes an HF directory in
NSA-1B's format (model_type llama-nsa) from a dense Llama model: every weight of SRC plus the NSA gate
projections, by default the fitted SmolLM2 gates shipped in checkpoints/nsa_smollm2_gates.safetensors,
or gates fitted now (`--fit-steps`, see `jaxspec.training.nsa_gates`; one line per 25 steps). DST also
holds the gates it used (nsa_gates.safetensors); `--gates-out` writes a freshly fitted gate file there
too, as soon as the fit ends. `--to-nsa` writes float32 unless `--dtype` says otherwise.
`--calibrate-reuse KL` also calibrates the refresh/reuse schedule of SSV's reuse precision classes
(`jaxspec.models.nsa_reuse`, on two training windows of T tokens) and saves it in config.json
(`nsa_refresh_layers`), with the calibration's report in nsa_reuse_calibration.json.

The checkpoint is written into a temporary directory beside DST and renamed into place, so DST is
either absent or complete: a failure at any point removes the temporary directory and leaves DST as
it was. `--force` replaces an existing DST (moved aside, then deleted once the new one is in place).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax

from jaxspec import files
from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec.loaders import hf, load_model, orbax
from jaxspec.models import nsa_convert, nsa_reuse
from jaxspec.models.config import NSAConfig, nsa_hf_keys
from jaxspec.training import data, nsa_gates
from jaxspec.xla_flags import set_gpu_flags


def convert(src: str, dst: Path, dtype: str = "bfloat16", force: bool = False) -> str:
    """Converts and returns the one-line summary."""
    if dst.exists() and not force:
        raise JaxspecError(f"{dst} already exists (use --force to replace it)")
    if not dst.parent.is_dir():
        raise JaxspecError(f"parent directory {dst.parent} does not exist")
    cfg, params, tokenizer = load_model(src, dtype)
    files.write_dir(dst, lambda tmp: orbax.save(tmp, cfg, params, tokenizer))
    count = sum(x.size for x in jax.tree.leaves(params))
    return f"wrote {dst} ({cfg.model_type}, {count / 1e6:.1f}M params, {dtype}) from {src}"


def convert_to_nsa(
    src: str,
    dst: Path,
    dtype: str = "float32",
    force: bool = False,
    *,
    nsa_cfg: NSAConfig = nsa_convert.DEFAULT_NSA,
    gates: Path | None = None,
    fit_steps: int = 0,
    fit_tokens: int = 2048,
    fit_batch: int = 2,
    fit_micro_batch: int = 1,
    lr: float = 3e-3,
    gates_out: Path | None = None,
    seed: int = 0,
    calibrate_reuse: float | None = None,
    calibrate_tokens: int = 2048,
    log=print,
) -> str:
    """Dense Llama SRC -> NSA HF directory DST (see the module docstring); returns the summary line.

    Gates: fitted now when `fit_steps` > 0, else read from `gates` (default: the shipped SmolLM2 file).
    Everything that can fail cheaply is checked before the fit; DST is written atomically after it.
    """
    if dst.exists() and not force:
        raise JaxspecError(f"{dst} already exists (use --force to replace it)")
    if not dst.parent.is_dir():
        raise JaxspecError(f"parent directory {dst.parent} does not exist")
    if fit_steps < 0:
        raise JaxspecError(f"--fit-steps must be >= 0, got {fit_steps}")
    if fit_steps and gates is not None:
        raise JaxspecError("--gates and --fit-steps exclude each other (a fit starts from zero gates)")
    if gates_out is not None and not fit_steps:
        raise JaxspecError("--gates-out needs --fit-steps N (it writes the gates fitted now)")
    if gates_out is not None and not gates_out.parent.is_dir():
        raise JaxspecError(f"parent directory {gates_out.parent} does not exist")
    if fit_steps and (fit_batch < 1 or fit_micro_batch < 1 or fit_batch % fit_micro_batch):
        raise JaxspecError(
            f"--fit-batch {fit_batch} must be a positive multiple of --fit-micro-batch {fit_micro_batch}"
        )
    if fit_steps and not (lr > 0):
        raise JaxspecError(f"--lr must be positive, got {lr}")
    if calibrate_reuse is not None and not calibrate_reuse >= 0:
        raise JaxspecError(f"--calibrate-reuse must be a KL bound >= 0, got {calibrate_reuse}")
    path = nsa_gates.SHIPPED_GATES if gates is None else gates
    if not fit_steps and not path.is_file():
        if gates is None:
            raise JaxspecError(f"the shipped gate file {path} is missing: pass --gates PATH or fit with --fit-steps N")
        raise JaxspecError(f"gate file {path} does not exist")
    cfg, params, tokenizer = load_model(src, "float32")
    nsa_convert.check_dense_llama(cfg)
    nsa_convert.nsa_model_config(cfg, nsa_cfg)  # validates the NSA settings against the model
    if fit_steps:
        if not nsa_cfg.block_size <= fit_tokens <= cfg.max_position_embeddings:
            raise JaxspecError(
                f"--fit-tokens must be between {nsa_cfg.block_size} and the context "
                f"{cfg.max_position_embeddings}, got {fit_tokens}"
            )
        g_proj, info = _fit(cfg, params, tokenizer, src, nsa_cfg, fit_steps, fit_tokens, fit_batch, fit_micro_batch,
                            lr, seed, log)
        if gates_out is not None:
            nsa_gates.save_gates(gates_out, g_proj, info)
            log(f"wrote {gates_out}")
    else:
        g_proj, info = nsa_gates.load_gates(path, cfg, nsa_cfg)
        fitted_to = info.get("source_fingerprint")
        if fitted_to and fitted_to != nsa_gates.model_fingerprint(params):
            print(f"warning: the gates in {path} were fitted to other weights ({info.get('source')}), not {src}'s",
                  file=sys.stderr)
    nsa_cfg_model, nsa_params = nsa_convert.to_nsa(cfg, params, nsa_cfg, g_proj)
    nsa_cfg_model = nsa_cfg_model.replace(dtype=dtype)
    nsa_params = jax.tree.map(lambda x: x.astype(dtype), nsa_params)
    calibration = None
    if calibrate_reuse is not None:
        if not nsa_cfg.block_size <= calibrate_tokens <= cfg.max_position_embeddings:
            raise JaxspecError(f"--calibrate-tokens must be between {nsa_cfg.block_size} and the context "
                               f"{cfg.max_position_embeddings}, got {calibrate_tokens}")
        tokens = next(data.training_batches(tokenizer, calibrate_tokens, 2, seed))
        backend = "pallas" if jax.default_backend() == "gpu" else "reference"
        log(f"calibrating the refresh/reuse schedule: KL bound {calibrate_reuse}, {tokens.shape[0]} x "
            f"{tokens.shape[1]} tokens, {backend} kernels")
        layers, calibration = nsa_reuse.calibrate(nsa_params, nsa_cfg_model, tokens, calibrate_reuse, backend, log)
        nsa_cfg_model = nsa_cfg_model.replace(nsa=dataclasses.replace(nsa_cfg_model.nsa, refresh_layers=layers))
        log(f"refresh layers {list(layers)} ({calibration['reuse_layers']} reuse layers, KL {calibration['kl']:.4f})")

    def write(tmp: Path) -> None:
        hf.write_hf(tmp, nsa_cfg_model, nsa_params, tokenizer)
        nsa_gates.save_gates(tmp / nsa_gates.GATES_FILE, g_proj, info)
        if calibration is not None:
            (tmp / "nsa_reuse_calibration.json").write_text(json.dumps(calibration, indent=1))

    files.write_dir(dst, write)
    count = sum(x.size for x in jax.tree.leaves(nsa_params))
    how = f"gates fitted in {fit_steps} steps" if fit_steps else f"gates from {path}"
    return f"wrote {dst} (llama-nsa, {count / 1e6:.1f}M params, {dtype}, {how}) from {src}"


def _fit(cfg, params, tokenizer, src, nsa_cfg, steps, tokens, batch, micro_batch, lr, seed, log):
    """Fits the gates on the training documents, with the held-out KL before and after; returns
    (g_proj, the gate file's metadata)."""
    import time

    import numpy as np

    heldout = data.heldout_windows(tokenizer, tokens, count=2)
    batches = data.training_batches(tokenizer, tokens, batch, seed)
    log(
        f"fitting NSA gates {list(nsa_convert.gate_shape(cfg))} of {src} on {jax.devices()[0].device_kind}: "
        f"{steps} steps of {batch} x {tokens} tokens, Adam lr {lr}, loss KL(dense || NSA), "
        f"NSA {nsa_hf_keys(nsa_cfg)}"
    )
    zeros = np.zeros(nsa_convert.gate_shape(cfg), np.float32)
    kl_before = nsa_gates.kl_divergence(cfg, params, zeros, heldout, nsa_cfg)
    start = time.perf_counter()
    history: list[float] = []
    g_proj = nsa_gates.fit_gates(cfg, params, batches, steps, lr, nsa_cfg=nsa_cfg, micro_batch=micro_batch,
                                   log=log, history=history)
    fit_s = time.perf_counter() - start
    kl_after = nsa_gates.kl_divergence(cfg, params, g_proj, heldout, nsa_cfg)
    log(f"held-out KL(dense || NSA) on {heldout.shape[0]} x {tokens} tokens: {kl_before:.4f} at zero gates, "
        f"{kl_after:.4f} fitted")
    info = {
        "source": src,
        "source_fingerprint": nsa_gates.model_fingerprint(params),
        "nsa": nsa_hf_keys(nsa_cfg),
        "fit": {
            "steps": steps, "tokens": tokens, "batch": batch, "micro_batch": micro_batch, "lr": lr, "seed": seed,
            "optimizer": "adam", "init": "zeros", "loss": "KL(dense || NSA), next-token distributions",
            "final_loss_mean_25": float(np.mean(history[-25:])), "seconds": round(fit_s, 1),
            "device": jax.devices()[0].device_kind,
            "heldout_kl_zero_gates": kl_before, "heldout_kl_fitted": kl_after,
        },
        "data": {
            "text": "jaxspec.corpus.documents() (CPython pydoc topics)",
            "heldout": f"pydoc topics with crc32(name) % {data.HELDOUT_MOD} == {data.HELDOUT_RESIDUE}, "
                       "never trained on",
            "heldout_sha256_16": data.heldout_fingerprint(),
        },
    }
    return g_proj, info


@cli_main
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m jaxspec.convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="smollm2, a .gguf file, an HF directory or a jaxspec checkpoint")
    parser.add_argument("dst", type=Path, help="checkpoint directory to create")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default bfloat16, or float32 with --to-nsa")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    nsa = parser.add_argument_group("--to-nsa: a dense Llama model -> NSA HF directory (NSA-1B format)")
    nsa.add_argument("--to-nsa", action="store_true", help="write an NSA model with fitted gate projections")
    nsa.add_argument("--gates", type=Path,
                     help=f"gate file to use (default {nsa_gates.SHIPPED_GATES.name} in checkpoints/)")
    nsa.add_argument("--fit-steps", type=int, default=0, help="fit the gates now, for N Adam steps")
    nsa.add_argument("--fit-tokens", type=int, default=2048, help="tokens per training window")
    nsa.add_argument("--fit-batch", type=int, default=2, help="windows per step")
    nsa.add_argument("--fit-micro-batch", type=int, default=1,
                     help="windows per forward/backward (gradients accumulated)")
    nsa.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    nsa.add_argument("--seed", type=int, default=0, help="seed of the training windows' offsets")
    nsa.add_argument("--gates-out", type=Path, help="also write the fitted gates to this gate file")
    default = nsa_convert.DEFAULT_NSA
    nsa.add_argument("--block-size", type=int, default=default.block_size)
    nsa.add_argument("--block-counts", type=int, default=default.block_counts)
    nsa.add_argument("--window-size", type=int, default=default.window_size)
    nsa.add_argument("--topk-rule", default=default.topk_rule, help="exact or nsa1b")
    nsa.add_argument("--calibrate-reuse", type=float, default=None, metavar="KL",
                     help="calibrate SSV's refresh/reuse schedule within this KL of the all-refresh model")
    nsa.add_argument("--calibrate-tokens", type=int, default=2048, help="tokens per calibration window")
    args = parser.parse_args(argv)
    nsa_flags = [flag for flag, value, unset in (
        ("--gates", args.gates, None), ("--fit-steps", args.fit_steps, 0), ("--gates-out", args.gates_out, None),
        ("--fit-tokens", args.fit_tokens, 2048), ("--fit-batch", args.fit_batch, 2),
        ("--fit-micro-batch", args.fit_micro_batch, 1), ("--lr", args.lr, 3e-3), ("--seed", args.seed, 0),
        ("--block-size", args.block_size, default.block_size),
        ("--block-counts", args.block_counts, default.block_counts),
        ("--window-size", args.window_size, default.window_size), ("--topk-rule", args.topk_rule, default.topk_rule),
        ("--calibrate-reuse", args.calibrate_reuse, None), ("--calibrate-tokens", args.calibrate_tokens, 2048),
    ) if value != unset]
    if not args.to_nsa:
        if nsa_flags:
            raise JaxspecError(f"{nsa_flags[0]} needs --to-nsa")
        print(convert(args.src, args.dst, args.dtype or "bfloat16", args.force))
        return
    nsa_cfg = NSAConfig(block_size=args.block_size, block_counts=args.block_counts, window_size=args.window_size,
                        topk_rule=args.topk_rule)
    log = lambda line: print(line, flush=True)
    print(convert_to_nsa(
        args.src, args.dst, args.dtype or "float32", args.force, nsa_cfg=nsa_cfg, gates=args.gates,
        fit_steps=args.fit_steps, fit_tokens=args.fit_tokens, fit_batch=args.fit_batch,
        fit_micro_batch=args.fit_micro_batch, lr=args.lr, gates_out=args.gates_out, seed=args.seed,
        calibrate_reuse=args.calibrate_reuse, calibrate_tokens=args.calibrate_tokens, log=log,
    ))


if __name__ == "__main__":
    set_gpu_flags()
    main()
