"""`python -m jaxspec.convert SRC DST [--dtype bfloat16|float32] [--force]`: any model -> jaxspec checkpoint.

The checkpoint is written into a temporary directory beside DST and renamed into place, so DST is
either absent or complete: a failure at any point removes the temporary directory and leaves DST as
it was. `--force` replaces an existing DST (moved aside, then deleted once the new one is in place).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import jax

from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec.loaders import load_model, orbax


def convert(src: str, dst: Path, dtype: str = "bfloat16", force: bool = False) -> str:
    """Converts and returns the one-line summary."""
    if dst.exists() and not force:
        raise JaxspecError(f"{dst} already exists (use --force to replace it)")
    if not dst.parent.is_dir():
        raise JaxspecError(f"parent directory {dst.parent} does not exist")
    cfg, params, tokenizer = load_model(src, dtype)
    tmp = _sibling(dst, "tmp")
    try:
        try:
            orbax.save(tmp, cfg, params, tokenizer)
        except OSError as e:
            raise JaxspecError(f"cannot write {dst}: {e}") from None
        _replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    count = sum(x.size for x in jax.tree.leaves(params))
    return f"wrote {dst} ({cfg.model_type}, {count / 1e6:.1f}M params, {dtype}) from {src}"


def _sibling(dst: Path, kind: str) -> Path:
    """A new hidden directory next to dst (same filesystem, so renames are atomic)."""
    path = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.{kind}"
    path.mkdir()
    return path


def _replace(tmp: Path, dst: Path) -> None:
    """Renames tmp to dst; an existing dst is moved aside first and restored if the rename fails."""
    if not dst.exists():
        tmp.rename(dst)
        return
    old = _sibling(dst, "old")
    dst.rename(old / "dst")
    try:
        tmp.rename(dst)
    except BaseException:
        (old / "dst").rename(dst)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


@cli_main
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m jaxspec.convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="smollm2, a .gguf file, an HF directory or a jaxspec checkpoint")
    parser.add_argument("dst", type=Path, help="checkpoint directory to create")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)
    print(convert(args.src, args.dst, args.dtype, args.force))


if __name__ == "__main__":
    main()
