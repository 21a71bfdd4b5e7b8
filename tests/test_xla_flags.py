"""Importing jaxspec changes nothing outside it; the entry points set the XLA GPU flags, before the
process's first JAX computation (docs/architecture.md, "XLA flags")."""

import subprocess
import sys

from jaxspec.xla_flags import GPU_FLAGS, set_gpu_flags

IMPORT_ALL = "import jaxspec.generate, jaxspec.serve, jaxspec.tune, jaxspec.profile, jaxspec.calibrate_skip, jaxspec.convert, jaxspec.train_eagle"


def python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_importing_leaves_the_environment_alone():
    assert python(f"import os\nbefore = dict(os.environ)\n{IMPORT_ALL}\nprint(dict(os.environ) == before)") == "True"


def test_flags_set_after_importing_reach_xla(tmp_path):
    """No import starts a JAX backend, so an entry point's flags, set after its imports, still apply:
    here a dump directory named only after every import receives the program."""
    code = (f"import os\n{IMPORT_ALL}\nos.environ['XLA_FLAGS'] = '--xla_dump_to={tmp_path}'\n"
            "import jax, jax.numpy as jnp\njax.jit(lambda x: x * 3)(jnp.arange(5.0)).block_until_ready()")
    python(code)
    assert any(p.name.endswith(".txt") for p in tmp_path.iterdir())


def test_flags_are_added():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    set_gpu_flags(env)
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x"] + [f"{k}={v}" for k, v in GPU_FLAGS.items()]
    env = {}
    set_gpu_flags(env)
    assert env["XLA_FLAGS"].split() == [f"{k}={v}" for k, v in GPU_FLAGS.items()]


def test_a_value_the_user_chose_is_kept():
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    set_gpu_flags(env)
    flags = env["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_triton_gemm=true" in flags and "--xla_gpu_enable_triton_gemm=false" not in flags
    assert "--xla_gpu_enable_dynamic_slice_fusion=true" in flags
