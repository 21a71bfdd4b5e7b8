"""jaxspec: lossless self-speculative decoding (Vegas) for long-context LLM inference in JAX.

Importing jaxspec sets two XLA GPU flags (unless XLA_FLAGS already names them), so import it before
running anything on the GPU. The model scans over layers whose weights are stacked [L, ...]; XLA's
Triton gemms copy each layer's slice before multiplying (0.9 TB/s of weight traffic on an H100),
while cuBLAS gemms with dynamic-slice fusion read the slice in place (2.5 TB/s): measured in
bench/NOTES.md ("decode step").
"""

import os

_XLA_FLAGS = {
    "--xla_gpu_enable_dynamic_slice_fusion": "true",
    "--xla_gpu_enable_triton_gemm": "false",
}
_current = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_current] + [f"{flag}={value}" for flag, value in _XLA_FLAGS.items() if flag not in _current]
).strip()
