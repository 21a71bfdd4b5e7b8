"""Files in and out. Outputs are written atomically: built under a hidden name beside the destination
(same filesystem), then renamed into place, so an error or an interrupt leaves the old output (or
none), never half of one. An OSError becomes a one-line JaxspecError naming the file, as does a JSON
input that cannot be read or is not an object."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from jaxspec.errors import JaxspecError


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path`; `what` names the file in the one-line errors."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bytes
        raise JaxspecError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(value, dict):
        raise JaxspecError(f"{what} {path} is not a JSON object")
    return value


def write_file(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) creates the file tmp; it then replaces `path`, with the usual permissions."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        usual_mode(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise JaxspecError(f"cannot write {path}: {e}") from None
    finally:
        with contextlib.suppress(OSError):  # no tmp, or no directory to hold one
            tmp.unlink(missing_ok=True)


def usual_mode(path: Path) -> None:
    """Gives the file the permissions open() would (safetensors creates its files private, 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_text(path: Path, text: str) -> None:
    """`path` holds `text`, atomically."""
    write_file(path, lambda tmp: tmp.write_text(text))


def write_dir(dst: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) fills a new directory tmp; it then replaces dst (an existing dst is moved aside
    first, restored if the rename fails, deleted once the new one is in place)."""
    try:
        tmp = _sibling(dst, "tmp")
    except OSError as e:
        raise JaxspecError(f"cannot write {dst}: {e}") from None
    try:
        try:
            write(tmp)
        except OSError as e:
            raise JaxspecError(f"cannot write {dst}: {e}") from None
        _replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sibling(dst: Path, kind: str) -> Path:
    """A new hidden directory next to dst."""
    path = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.{kind}"
    path.mkdir()
    return path


def _replace(tmp: Path, dst: Path) -> None:
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
