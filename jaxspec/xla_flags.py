"""The XLA GPU flags jaxspec's programs are built for, set by the entry points and never on import.

The model scans over layers whose weights are stacked [L, ...]. XLA's Triton gemms copy each layer's
slice before multiplying; cuBLAS gemms with dynamic-slice fusion read the slice in place, at several
times the weight bandwidth (bench/NOTES.md, "Decode step"). XLA reads XLA_FLAGS once, when its first backend
starts, so `set_gpu_flags` must run before the process's first JAX computation: `python -m
jaxspec.generate` and the other entry points call it first thing; a library user on a GPU may call it
the same way, or set the flags themselves.
"""

from __future__ import annotations

import os
from typing import MutableMapping

GPU_FLAGS = {
    "--xla_gpu_enable_dynamic_slice_fusion": "true",
    "--xla_gpu_enable_triton_gemm": "false",
}


def set_gpu_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds `GPU_FLAGS` to XLA_FLAGS in `environ`, keeping any value already chosen for one of them."""
    current = environ.get("XLA_FLAGS", "")
    named = {word.split("=", 1)[0] for word in current.split()}
    added = [f"{flag}={value}" for flag, value in GPU_FLAGS.items() if flag not in named]
    environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
