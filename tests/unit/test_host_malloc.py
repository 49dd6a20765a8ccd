"""glibc malloc thresholds for CPU runs (``hpc_rlhf.utils.host_malloc``)."""

import subprocess
import sys

import pytest

from hpc_rlhf.utils import host_malloc

# A child process, so that the probe's mallopt calls do not outlive it. It asks for 64 MiB and says whether
# that came from the heap (raised thresholds) or from a mapping of its own (glibc's default above 32 MiB).
PROBE = """
import ctypes, sys
from hpc_rlhf.utils.host_malloc import retain_freed_host_memory
applied = retain_freed_host_memory(on_gpu=sys.argv[1] == "gpu")
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
address = libc.malloc(64 << 20)
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
start, end = (int(x, 16) for x in heap[0].split("-")) if heap else (0, 0)
print(int(applied), int(start <= address < end))
"""


def _probe(device: str, env: dict | None = None) -> tuple[int, int]:
    import os

    out = subprocess.run([sys.executable, "-c", PROBE, device], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    applied, in_heap = out.stdout.split()
    return int(applied), int(in_heap)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")
def test_cpu_runs_reuse_freed_large_buffers_and_gpu_runs_keep_glibc_defaults():
    assert _probe("cpu") == (1, 1)  # thresholds raised: 64 MiB comes from the heap
    assert _probe("gpu") == (0, 0)  # glibc's default: a mapping of its own
    assert _probe("cpu", {host_malloc.OPT_OUT_VARIABLE: "default"}) == (0, 0)
