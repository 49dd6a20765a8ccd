"""Which Adam implementation a trained role's DeepSpeed engine steps with, and why. Pure; imports no torch.

Left to itself, DeepSpeed 0.19 steps an ``"AdamW"`` optimizer section with its own ``FusedAdam`` on GPU,
a CUDA op JIT-compiled on first use by nvcc: a node without the CUDA toolkit fails with
``MissingCUDAException``, and an nvcc whose CUDA differs from torch's is refused. torch ships a fused AdamW
CUDA kernel of its own, so we ask DeepSpeed for ``torch.optim.AdamW`` (its ``torch_adam`` parameter) and pass
``fused=True`` through (DeepSpeed hands the remaining optimizer parameters to the torch constructor).

Two cases need a DeepSpeed op. ZeRO optimizer offload (``ds.adam_offload`` at ZeRO stage >= 1): Adam then
steps on the host with ``DeepSpeedCPUAdam``. And ZeRO-3 on GPU without it: ZeRO-3 runs only in the colocated
layout, where training states leave the GPU while the rollout engine generates, and DeepSpeed 0.19's ZeRO-3
``offload_states`` moves Adam states and fp32 master weights only from its own ``FusedAdam`` (it asserts so);
with torch's AdamW they would stay on the GPU through generation. ``FusedAdam`` is JIT-built by nvcc on first
use (the CUDA toolkit at torch's CUDA major version), or ahead of time with ``DS_BUILD_FUSED_ADAM=1`` when
deepspeed is installed. DeepSpeed 0.19.8 builds that op from its C++ sources on
first use with ``torch.utils.cpp_extension`` (a ``CppExtension``, also on CUDA machines: host-side optimizers
share the CPU accelerator's builders): it needs a C++ compiler with OpenMP (``g++``), the Python headers and
``ninja`` (a dependency of deepspeed), not nvcc. Installing deepspeed with ``DS_BUILD_CPU_ADAM=1`` builds it
ahead of time instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdamImplementation:
    """``name``: what runs the Adam step; ``reason``: why; ``ds_params``: keys for DeepSpeed's optimizer params."""

    name: str
    reason: str
    ds_params: dict = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.name} -- {self.reason}"


def optimizer_offloaded(adam_offload: bool, zero_stage: int) -> bool:
    """ZeRO-Offload of the optimizer runs only with a ZeRO optimizer (stage >= 1, as DeepSpeed runs it)."""
    return adam_offload and zero_stage > 0


def adam_implementation(*, on_gpu: bool, offloaded: bool, zero_stage: int = 0) -> AdamImplementation:
    """The Adam a trained role uses: ``offloaded`` from ``optimizer_offloaded``; ``on_gpu``: parameters on CUDA;
    ``zero_stage``: the stage DeepSpeed runs (after ``effective_zero_stage``'s collapse on one rank)."""
    if offloaded:
        return AdamImplementation(
            "DeepSpeedCPUAdam",
            "ds.adam_offload: Adam steps on the host; DeepSpeed JIT-builds its cpu_adam C++ op on first use "
            "with g++ (OpenMP), the Python headers and ninja; no nvcc")
    if on_gpu and zero_stage == 3:
        return AdamImplementation(
            "DeepSpeed FusedAdam",
            "ZeRO-3 (colocated): offload_states moves Adam states off the GPU for generation only from "
            "DeepSpeed's FusedAdam; nvcc at torch's CUDA major JIT-builds it on first use (or DS_BUILD_FUSED_ADAM=1 "
            "at install); ds.adam_offload=true needs no nvcc")
    if on_gpu:
        return AdamImplementation(
            "torch.optim.AdamW(fused=True)",
            "torch's fused CUDA kernel, shipped with torch; DeepSpeed's FusedAdam would be compiled by nvcc",
            {"torch_adam": True, "fused": True})
    return AdamImplementation(
        "torch.optim.AdamW(fused=True)",
        "CPU: torch's fused CPU kernel, no compiled op needed (15x faster than its default per-tensor loop "
        "at 135M parameters)", {"torch_adam": True, "fused": True})


def arch_list_for_deepspeed(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed 0.19's JIT op builder can read it.

    torch accepts architecture-specific entries such as ``9.0a`` (Hopper's wgmma) or ``10.0f``; DeepSpeed parses
    every entry as integers and fails on them (``invalid literal for int() with base 10: '0a'``, seen building
    FusedAdam on an H200 whose environment set ``9.0a``). Its ops use no such instructions, so the suffix is
    dropped: ``"8.0;9.0a+PTX"`` -> ``"8.0;9.0+PTX"``. Separators (spaces or ``;``) become ``;``."""
    entries = []
    for entry in arch_list.replace(" ", ";").split(";"):
        if not entry.strip():
            continue
        base, plus, ptx = entry.strip().partition("+")
        major, _, minor = base.partition(".")
        entries.append(f"{major}.{minor.rstrip('abcdefghijklmnopqrstuvwxyz')}{plus}{ptx}" if minor else entry.strip())
    return ";".join(entries)
