"""The container definitions (containers/) agree with the GPU install they package and with each other.

No image is built here (that needs a container engine and the internet): these check that containers/Containerfile
installs what docs/gpu.md and environment.yml install, in the same way, and that the Apptainer definition, the
build context and the docs name the same image.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "containers/Containerfile"
DEF = ROOT / "containers/hpc-rlhf.def"
IGNORE = ROOT / "containers/Containerfile.dockerignore"
# variables slurm/launch.sh sets per job: an image that set them would shadow the job's value
JOB_VARIABLES = re.compile(r"^(OMP_NUM_THREADS|NCCL_\w+|TORCH_NCCL_\w+|PYTHONPATH|TOKENIZERS_PARALLELISM|"
                           r"PYTHONUNBUFFERED|HPC_RLHF_\w+|MASTER_ADDR|MASTER_PORT)$")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in CONTAINERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        keyword, _, args = current.strip().partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
        current = ""
    return out


def _args() -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in _instructions() if k == "ARG" and "=" in a)


def _pip_installs() -> list[list[str]]:
    """The arguments of every `pip install` in the RUN lines, with the ARG defaults filled in."""
    args = _args()
    installs = []
    for keyword, command in _instructions():
        if keyword != "RUN":
            continue
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands, words = [], []
        for token in lexer:
            if token in ("&&", ";", "then", "||"):
                commands.append(words)
                words = []
            else:
                words.append(token)
        for words in [*commands, words]:
            while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value before the command
                words = words[1:]
            if words[:2] == ["pip", "install"]:
                installs.append([re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], w) for w in words[2:]])
    return installs


def _supported_vllm() -> dict[str, str]:
    """docs/gpu.md "Supported stack": vLLM version -> its torch row's CUDA runtime ("13.0")."""
    table = (ROOT / "docs/gpu.md").read_text().split("## Supported stack", 1)[1].split("\n\n", 2)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    return {row[0]: row[2].split()[0] for row in rows}


def _environment_yml_extras() -> set[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    (pip_step,) = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    (extras,) = [re.fullmatch(r"-e \.\[([\w,-]+)\]", line.strip()).group(1) for line in pip_step
                 if line.strip().startswith("-e .")]
    return set(extras.split(","))


def test_the_project_is_installed_with_the_extras_environment_yml_installs():
    projects = [w for words in _pip_installs() for w in words if w.startswith(".[")]
    assert len(projects) == 1, projects
    assert set(projects[0][2:-1].split(",")) == _environment_yml_extras()


def test_vllm_is_a_supported_release_and_brings_torch():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    gpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    (vllm_extra,) = [Requirement(r) for r in gpu_extra if Requirement(r).name == "vllm"]
    version = _args()["VLLM_VERSION"]
    assert version in _supported_vllm(), f"VLLM_VERSION={version} is not in docs/gpu.md's Supported stack"
    assert Version(version) in vllm_extra.specifier, f"VLLM_VERSION={version} is outside the gpu extra's {vllm_extra}"
    pins = [Requirement(w) for words in _pip_installs() for w in words if w.startswith("vllm")]
    assert [str(p.specifier) for p in pins] == [f"=={version}"]
    # torch comes from vLLM's pin only, never from a channel of its own (docs/gpu.md, "Install")
    names = {Requirement(w).name for words in _pip_installs() for w in words if re.match(r"[A-Za-z]", w)}
    assert not names & {"torch", "torchvision", "torchaudio"}, names


def test_base_image_has_the_cuda_of_that_torch():
    cuda = _supported_vllm()[_args()["VLLM_VERSION"]]
    image = _args()["CUDA_IMAGE"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?devel-ubuntu[\d.]+", image)
    assert match, f"CUDA_IMAGE={image}: a CUDA devel image (nvcc for DeepSpeed's JIT ops and flash-attn)"
    assert match.group(1) == cuda.split(".")[0], f"{image} against torch's CUDA {cuda}"  # nvcc's major must match
    assert ("FROM", "${CUDA_IMAGE}") in _instructions()


def test_flash_attn_as_docs_gpu_md_installs_it():
    docs = (ROOT / "docs/gpu.md").read_text().split("## Install", 1)[1]
    (spec,) = set(re.findall(r'pip install --no-build-isolation "(flash-attn[^"]*)"', docs))
    flash = [words for words in _pip_installs() if any(w.startswith("flash-attn") for w in words)]
    assert flash == [["--no-cache-dir", "--no-build-isolation", spec]]
    assert _args()["FLASH_ATTN"] == "0"  # optional, as in docs/gpu.md: the recipes run without it


def test_image_sets_no_variable_the_job_sets():
    names = []
    for keyword, args in _instructions():
        if keyword == "ENV":
            names += re.findall(r"(\w+)=", args)
    assert names and not [n for n in names if JOB_VARIABLES.match(n)], names


def test_build_context_keeps_what_the_image_copies():
    kept = [line[1:] for line in IGNORE.read_text().splitlines() if line.startswith("!")]
    assert "*" in IGNORE.read_text().splitlines()
    copied = [src for keyword, args in _instructions() if keyword == "COPY" for src in args.split()[:-1]]
    assert copied and set(copied) <= set(kept), (copied, kept)


def test_apptainer_definition_and_docs_name_the_same_image():
    header = DEF.read_text().splitlines()
    assert header[0] == "Bootstrap: docker-daemon"  # first, as Apptainer requires
    image = header[1].removeprefix("From: ")
    build = f"-t {image} -f containers/Containerfile ."
    assert build in CONTAINERFILE.read_text() and build in DEF.read_text()
    slurm_md = (ROOT / "docs/slurm.md").read_text().split("## Containers", 1)[1].split("\n## ", 1)[0]
    assert build in slurm_md and f"dockerd://{image}" in slurm_md and "containers/hpc-rlhf.def" in slurm_md
    assert "not been run" in slurm_md  # the docs say what was not exercised
