"""Which Adam implementation a trained role's DeepSpeed engine steps with, and why. Pure; imports no torch.

Left to itself, DeepSpeed 0.19 steps an ``"AdamW"`` optimizer section with its own ``FusedAdam`` on GPU,
a CUDA op JIT-compiled on first use by nvcc: a node without the CUDA toolkit fails with
``MissingCUDAException``, and an nvcc whose CUDA differs from torch's is refused. torch ships a fused AdamW
CUDA kernel of its own, so we ask DeepSpeed for ``torch.optim.AdamW`` (its ``torch_adam`` parameter) and pass
``fused=True`` through (DeepSpeed hands the remaining optimizer parameters to the torch constructor).

The one case that needs a DeepSpeed op is ZeRO optimizer offload (``ds.adam_offload`` at ZeRO stage >= 1):
Adam then steps on the host with ``DeepSpeedCPUAdam``. DeepSpeed 0.19.8 builds that op from its C++ sources on
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


def adam_implementation(*, on_gpu: bool, offloaded: bool) -> AdamImplementation:
    """The Adam a trained role uses: ``offloaded`` from ``optimizer_offloaded``; ``on_gpu``: parameters on CUDA."""
    if offloaded:
        return AdamImplementation(
            "DeepSpeedCPUAdam",
            "ds.adam_offload: Adam steps on the host; DeepSpeed JIT-builds its cpu_adam C++ op on first use "
            "with g++ (OpenMP), the Python headers and ninja; no nvcc")
    if on_gpu:
        return AdamImplementation(
            "torch.optim.AdamW(fused=True)",
            "torch's fused CUDA kernel, shipped with torch; DeepSpeed's FusedAdam would be compiled by nvcc",
            {"torch_adam": True, "fused": True})
    return AdamImplementation("torch.optim.AdamW", "CPU: no compiled op needed", {"torch_adam": True})
