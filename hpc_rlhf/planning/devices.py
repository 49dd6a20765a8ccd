"""Device descriptions for the step-time model (``hpc_rlhf.planning.step_time``), as data. Pure Python.

Every number carries its source. The GPU numbers are assumptions taken from vendor datasheets and published
benchmarks (nothing in this project ran on a GPU to check them); the CPU numbers were measured on the 2-core
AMD EPYC machine of docs/benchmarks.md and fitted to its measured phase times (docs/step_time.md).

Units: FLOP/s, bytes/s and seconds. Bandwidths are per GPU (per node for the CPU description, whose ranks
share it) and in bytes, not bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GB = 1e9


@dataclass(frozen=True)
class Device:
    """What one accelerator (or, ``shared_by_ranks``, one CPU node split over its ranks) can do.

    ``mfu``: the fraction of ``peak_flops`` a training or scoring forward reaches (model FLOPs utilisation).
    ``decode_efficiency``: the fraction of ``memory_bw`` a decode step reaches. ``layer_overhead_s``: fixed cost
    of one decoder layer in one forward pass (kernel dispatch, Python), independent of the tokens.
    ``step_overhead_s``: fixed cost of one optimizer step (DeepSpeed's step, gradient collectives' latency).
    """

    name: str
    peak_flops: float
    memory_bw: float
    intra_node_bw: float
    inter_node_bw: float
    host_link_bw: float
    mfu: float
    decode_efficiency: float
    fs_bw: float
    layer_overhead_s: float
    step_overhead_s: float
    host_adam_s_per_gparam: float
    shared_by_ranks: bool = False
    gpu: bool = True
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def per_rank(self, ranks_per_node: int) -> Device:
        """This device as one rank sees it: a CPU node's compute and memory bandwidth are split over its ranks."""
        if not self.shared_by_ranks or ranks_per_node <= 1:
            return self
        return replace(self, peak_flops=self.peak_flops / ranks_per_node, memory_bw=self.memory_bw / ranks_per_node)

    def collective_bw(self, nodes: int) -> float:
        """Bandwidth of a collective over ranks on ``nodes`` nodes: NVLink inside one node, the NIC across."""
        return self.intra_node_bw if nodes <= 1 else self.inter_node_bw


_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_NVIDIA_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/"
_NCCL_TESTS = ("nccl-tests all_reduce busbw at large sizes: 8xH100 SXM 460-480 GB/s, 8xA100 SXM 230-250 GB/s, "
               "https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests")
_MEGATRON_MFU = ("Megatron-LM, Korthikanti et al. 2022 (arXiv:2205.05198): 40-56 % MFU for dense GPT; "
                 "~400 TFLOP/s on H100 = 40 % of 989 (Megatron-LM README); ZeRO-3 with HF models assumed lower: 35 %")
_DECODE = ("vLLM decode reaches 62 % of HBM bandwidth (Llama-4-Scout, 8xH100 TP 8, "
           "https://evokernel-specs.pages.dev/en/cases/case-llama4-scout-h100x8-vllm-001/) and 77 % at batch 1 "
           "(Llama-3.1-8B, A100, https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on); 60 % assumed")
_IB_NDR = "one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s; 40 GB/s assumed reachable by NCCL (assumption)"
_IB_HDR = "one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s; 20 GB/s assumed reachable by NCCL (assumption)"
_CPU_ADAM = ("DeepSpeed CPU-Adam, ZeRO-Offload, Ren et al. 2021 (arXiv:2101.06840): ~0.2-0.3 s per billion "
             "parameters per process; 0.3 s assumed")
_FS = ("conservative default for a shared filesystem seen by one job: 2 GB/s (NFS ~1 GB/s, Lustre / GPFS "
       "10-100 GB/s); set --fs-gbps to your site's number (assumption)")
_GPU_OVERHEAD = "kernel launches of a HF decoder layer, ~20 kernels x ~5 us, plus Python (assumption)"
_CPU_MEASURED = ("measured on the 2-core AMD EPYC of docs/benchmarks.md ('Against the floor'): fp32 GEMM "
                 "736x576x1536 227 GFLOP/s, 16-row decode GEMMs read weights at ~11 GB/s")
_CPU_FITTED = ("fitted to the measured phase times of the three CPU shapes of docs/step_time.md "
               "(grpo_tiny_cpu, the 3.2M-parameter benchmark, SmolLM2-135M shape)")

DEVICES: dict[str, Device] = {
    "h100": Device(
        "NVIDIA H100 SXM 80GB (assumed numbers)", peak_flops=989e12, memory_bw=3.35e12, intra_node_bw=450 * GB,
        inter_node_bw=40 * GB, host_link_bw=50 * GB, mfu=0.35, decode_efficiency=0.6, fs_bw=2 * GB,
        layer_overhead_s=100e-6, step_overhead_s=0.5, host_adam_s_per_gparam=0.3,
        sources={"peak_flops": f"989 TFLOP/s dense BF16, {_NVIDIA_H100}",
                 "memory_bw": f"3.35 TB/s HBM3, {_NVIDIA_H100}",
                 "intra_node_bw": _NCCL_TESTS, "inter_node_bw": _IB_NDR,
                 "host_link_bw": "PCIe Gen5 x16, 64 GB/s per direction, ~50 reachable (assumption)",
                 "mfu": _MEGATRON_MFU, "decode_efficiency": _DECODE, "fs_bw": _FS, "layer_overhead_s": _GPU_OVERHEAD,
                 "step_overhead_s": "DeepSpeed optimizer step bookkeeping (assumption)",
                 "host_adam_s_per_gparam": _CPU_ADAM}),
    "a100": Device(
        "NVIDIA A100 SXM 80GB (assumed numbers)", peak_flops=312e12, memory_bw=2.039e12, intra_node_bw=240 * GB,
        inter_node_bw=20 * GB, host_link_bw=25 * GB, mfu=0.35, decode_efficiency=0.6, fs_bw=2 * GB,
        layer_overhead_s=100e-6, step_overhead_s=0.5, host_adam_s_per_gparam=0.3,
        sources={"peak_flops": f"312 TFLOP/s dense BF16, {_NVIDIA_A100}",
                 "memory_bw": f"2.039 TB/s HBM2e, {_NVIDIA_A100}",
                 "intra_node_bw": _NCCL_TESTS, "inter_node_bw": _IB_HDR,
                 "host_link_bw": "PCIe Gen4 x16, 32 GB/s per direction, ~25 reachable (assumption)",
                 "mfu": _MEGATRON_MFU, "decode_efficiency": _DECODE, "fs_bw": _FS, "layer_overhead_s": _GPU_OVERHEAD,
                 "step_overhead_s": "as H100 (assumption)", "host_adam_s_per_gparam": _CPU_ADAM}),
    "cpu": Device(
        "CPU node (2-core AMD EPYC, fp32, gloo; measured)", peak_flops=227e9, memory_bw=11 * GB,
        intra_node_bw=2 * GB, inter_node_bw=1 * GB, host_link_bw=11 * GB, mfu=0.85, decode_efficiency=0.8,
        fs_bw=0.5 * GB, layer_overhead_s=0.6e-3, step_overhead_s=8e-3, host_adam_s_per_gparam=3.0,
        shared_by_ranks=True, gpu=False,
        sources={"peak_flops": _CPU_MEASURED, "memory_bw": _CPU_MEASURED,
                 "intra_node_bw": "gloo over shared memory on one node (assumption)",
                 "inter_node_bw": "gloo over TCP, 10 Gb/s Ethernet (assumption)",
                 "host_link_bw": "host memory: same as memory_bw", "mfu": _CPU_FITTED,
                 "decode_efficiency": _CPU_FITTED, "fs_bw": "local disk, conservative (assumption)",
                 "layer_overhead_s": _CPU_FITTED, "step_overhead_s": _CPU_FITTED,
                 "host_adam_s_per_gparam": "Adam on the CPU ranks themselves (assumption)"}),
}
# The H200 is an H100 with HBM3e: same compute, NVLink and host link; only the memory bandwidth differs.
DEVICES["h200"] = replace(
    DEVICES["h100"], name="NVIDIA H200 SXM 141GB (assumed numbers)", memory_bw=4.8e12,
    sources={**DEVICES["h100"].sources, "peak_flops": f"989 TFLOP/s dense BF16, {_NVIDIA_H200}",
             "memory_bw": f"4.8 TB/s HBM3e, {_NVIDIA_H200}", "intra_node_bw": _NCCL_TESTS + " (same NVLink 4 as H100)"})


def get_device(name: str, *, intra_node_gbps: float | None = None, inter_node_gbps: float | None = None,
               fs_gbps: float | None = None) -> Device:
    """A device description by name (``DEVICES``), with the site's bandwidths (GB/s) in place of the defaults."""
    try:
        device = DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; one of {', '.join(DEVICES)}") from None
    if intra_node_gbps is not None:
        device = replace(device, intra_node_bw=intra_node_gbps * GB)
    if inter_node_gbps is not None:
        device = replace(device, inter_node_bw=inter_node_gbps * GB)
    if fs_gbps is not None:
        device = replace(device, fs_bw=fs_gbps * GB)
    return device
