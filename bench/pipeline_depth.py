"""How deep Triton pipelines each Pallas kernel: a pytest plugin that records every sm_90 compile of
tests/test_kernels_lowering.py (no GPU needed; torch's Triton).

    PIPELINE_DEPTH_OUT=FILE python -m pytest -q -p bench.pipeline_depth tests/test_kernels_lowering.py -m "slow or not slow"

Appends a line per compiled kernel to FILE: the test case, the kernel, its pipeline stages, shared
memory bytes and cp.async instructions. Shared memory is the depth's measure: a kernel whose key
blocks wait on a page-table read keeps fewer blocks in flight at the same stages (bench/NOTES.md,
"Paged KV cache"). Run it from two trees to compare a change.
"""

import os
import re

import triton

_compile = triton.compile


def _recording_compile(src, *args, **kwargs):
    kernel = _compile(src, *args, **kwargs)
    text = open(src).read() if isinstance(src, str) and os.path.exists(src) else ""
    name = re.search(r"tt\.func (?:public )?@(\w+)", text)
    case = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[-1]
    with open(os.environ["PIPELINE_DEPTH_OUT"], "a") as f:
        f.write(f"{case}\t{name.group(1) if name else '?'}\t{kwargs.get('options', {}).get('num_stages')}\t"
                f"{kernel.metadata.shared}\t{len(re.findall(r'cp[.]async[.]', kernel.asm['ptx']))}\n")
    return kernel


triton.compile = _recording_compile
