"""jaxspec: lossless speculative decoding for long-context LLM inference in JAX, with Pallas kernels.

Importing jaxspec changes nothing outside it: the XLA GPU flags its programs are built for are set
by the entry points (`jaxspec.xla_flags`). docs/architecture.md maps the package.
"""
