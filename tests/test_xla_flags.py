"""Importing jaxspec sets the XLA GPU flags that make the layer scan read weights in place, without
overriding a value the user chose (bench/NOTES.md, "Decode step")."""

import subprocess
import sys


def flags_after_import(initial: str | None) -> str:
    code = "import os\n"
    if initial is not None:
        code += f"os.environ['XLA_FLAGS'] = {initial!r}\n"
    code += "import jaxspec\nprint(os.environ['XLA_FLAGS'])"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_flags_are_set():
    flags = flags_after_import(None).split()
    assert "--xla_gpu_enable_dynamic_slice_fusion=true" in flags
    assert "--xla_gpu_enable_triton_gemm=false" in flags


def test_user_choice_is_kept():
    flags = flags_after_import("--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x").split()
    assert "--xla_gpu_enable_triton_gemm=true" in flags and "--xla_gpu_enable_triton_gemm=false" not in flags
    assert "--xla_dump_to=/tmp/x" in flags and "--xla_gpu_enable_dynamic_slice_fusion=true" in flags
