"""CPU training: let glibc keep freed host memory for the next step instead of returning it to the kernel.

glibc serves an allocation above its mmap threshold (128 KiB, raised on its own up to 32 MiB) with a fresh
``mmap`` and unmaps it on free, and it trims the top of the heap beyond its trim threshold. A training step
on CPU frees and allocates the same large tensors every step (at SmolLM2-135M's shape: the 113 MB embedding
and LM-head gradients, 16 MiB log-prob chunks, activations), so every step page-faults them in again. That
was ~13 % of the train phase there (``docs/benchmarks.md``). With both thresholds at 1 GiB those buffers
come back from the heap already mapped.

The cost: memory a step frees (up to 1 GiB at the heap's top, and freed chunks below it, as always) stays
with the process for reuse instead of going back to the system, so RSS stays near its peak between steps;
allocations above 1 GiB are still mapped and unmapped each time. Applied only without CUDA (on a GPU node the
host-side churn is small and this was not measured there) and only under glibc. ``HPC_RLHF_HOST_MALLOC=default``
leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
RETAIN_BYTES = 1 << 30
OPT_OUT_VARIABLE = "HPC_RLHF_HOST_MALLOC"


def retain_freed_host_memory(on_gpu: bool) -> bool:
    """Raise glibc's mmap and trim thresholds to :data:`RETAIN_BYTES` (see the module docstring).

    Returns whether they were set: not on GPU runs, not outside glibc, not when ``HPC_RLHF_HOST_MALLOC=default``.
    """
    if on_gpu or os.environ.get(OPT_OUT_VARIABLE, "").lower() == "default" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    accepted = all(libc.mallopt(param, ctypes.c_int(RETAIN_BYTES)) == 1
                   for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    if accepted:
        log.info("CPU run: glibc keeps freed host memory for reuse (mmap/trim thresholds %d MiB; %s=default turns "
                 "this off)", RETAIN_BYTES >> 20, OPT_OUT_VARIABLE)
    else:
        log.warning("glibc refused mallopt thresholds of %d bytes: host malloc left at its defaults", RETAIN_BYTES)
    return accepted
