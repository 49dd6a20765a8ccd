"""A login node has no GPU stack: the package, config, placement and plan must import without it."""

import subprocess
import sys

import pytest

HEAVY = ("deepspeed", "vllm", "flash_attn", "ring_flash_attn", "liger_kernel")


@pytest.mark.parametrize(
    "module",
    ["hpc_rlhf", "hpc_rlhf.config", "hpc_rlhf.world", "hpc_rlhf.world.placement", "hpc_rlhf.planning.memory_estimate",
     "hpc_rlhf.planning.model_shape", "hpc_rlhf.planning.lora_memory", "hpc_rlhf.cli.plan", "hpc_rlhf.cli.main"],
)
def test_module_imports_no_gpu_stack(module):
    code = (f"import sys, {module}; heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"


@pytest.mark.parametrize("module", ["hpc_rlhf.config", "hpc_rlhf.world.placement", "hpc_rlhf.cli.plan"])
def test_login_node_modules_import_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
