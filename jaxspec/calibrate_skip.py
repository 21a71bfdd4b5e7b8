"""`python -m jaxspec.calibrate_skip`: choose the layers a draft skips (`--draft-skip calibrated`).

    python -m jaxspec.calibrate_skip [--model smollm2] [--draft-weights exact|int8|int4]
        [--min-acceptance 0.8] [--tokens 1024] [--windows 2] [--out FILE]

Greedy on local text (`draft_weights.calibrate_skip`: teacher-forced windows of the CPython docs'
training split). The result is saved beside the model: `draft_skip.json` inside a model directory,
`<file>.draft_skip.json` beside a .gguf file; `generate`/`serve --draft-skip calibrated` read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from jaxspec import files
from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec.models import draft_weights
from jaxspec.xla_flags import set_gpu_flags

SKIP_FILE = "draft_skip.json"


def skip_file(model: str) -> Path:
    """Where the calibration of `model` (a --model value) is saved."""
    from jaxspec.loaders import smollm2_path

    path = smollm2_path() if model == "smollm2" else Path(model)
    return path / SKIP_FILE if path.is_dir() else path.with_name(path.name + "." + SKIP_FILE)


def resolve_skip(text: str | None, model: str, num_layers: int) -> tuple[int, ...]:
    """The layers `--draft-skip text` names: a list, everyN, `calibrated` (the model's saved
    calibration) or a calibration file."""
    if not text:
        return ()
    if text == "calibrated" or text.endswith(".json"):
        path = skip_file(model) if text == "calibrated" else Path(text)
        if not path.is_file():
            raise JaxspecError(f"--draft-skip {text}: no calibration at {path} (run python -m jaxspec.calibrate_skip)")
        try:
            skip = tuple(int(i) for i in json.loads(path.read_text())["skip"])
        except (ValueError, KeyError, TypeError) as e:
            raise JaxspecError(f"--draft-skip {text}: {path} is not a calibration file ({e})") from None
        draft_weights.check_skip(skip, num_layers)
        return skip
    return draft_weights.parse_skip(text, num_layers)


@cli_main
def main(argv=None) -> None:
    p = ArgumentParser(prog="python -m jaxspec.calibrate_skip", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | a .gguf file | HF directory | orbax checkpoint")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    p.add_argument("--draft-weights", choices=draft_weights.DRAFT_WEIGHTS, default="exact",
                   help="the weights the skipping draft reads (calibrate with the ones you will run)")
    p.add_argument("--min-acceptance", type=float, default=0.8,
                   help="lowest one-token acceptance (temperature 1) the skipping draft may have")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per calibration window")
    p.add_argument("--windows", type=int, default=2, help="calibration windows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default: beside the model")
    args = p.parse_args(argv)
    if not 0 < args.min_acceptance <= 1:
        raise JaxspecError(f"--min-acceptance must be in (0, 1], got {args.min_acceptance}")
    if args.tokens < 2 or args.windows < 1:
        raise JaxspecError(f"need --tokens >= 2 and --windows >= 1, got {args.tokens} and {args.windows}")
    from jaxspec.loaders import load_model
    from jaxspec.training.data import training_batches

    out = args.out or skip_file(args.model)
    cfg, params, tokenizer = load_model(args.model, dtype=args.dtype)
    if args.tokens > cfg.max_position_embeddings:
        raise JaxspecError(f"--tokens {args.tokens} is past the model's context {cfg.max_position_embeddings}")
    tokens = jnp.asarray(next(training_batches(tokenizer, args.tokens, args.windows, args.seed)))
    result = draft_weights.calibrate_skip(params, cfg, tokens, args.draft_weights, args.min_acceptance,
                                          log=lambda line: print(line, flush=True))
    files.write_text(out, json.dumps({"model": args.model, **result}, indent=1))
    print(f"skip {len(result['skip'])} of {cfg.num_layers} layers {result['skip']}: acceptance "
          f"{result['acceptance']:.3f} (every layer: {result['acceptance_all_layers']:.3f}); saved {out}")


if __name__ == "__main__":
    set_gpu_flags()
    main()
