"""The name and address of flash-attn's prebuilt release wheel for the installed torch (docs/gpu.md, "Install").

flash-attn publishes its wheels only as GitHub release assets, named as its ``setup.py`` guesses them
(``get_wheel_url`` in 2.8.3.post1): ``flash_attn-<version>+cu<CUDA major>torch<major.minor>cxx11abi<TRUE|FALSE>
-cp<py>-cp<py>-linux_x86_64.whl``. ``python -m hpc_rlhf.utils.flash_attn_wheel 2.8.3.post1`` prints the address
for this environment, for nodes without the CUDA compiler that ``pip install flash-attn`` needs.
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

RELEASES = "https://github.com/Dao-AILab/flash-attention/releases/download"


def wheel_name(flash_attn_version: str, torch_version: str, torch_cuda: str, cxx11_abi: bool,
               python: tuple[int, int], machine: str = "x86_64") -> str:
    """e.g. ``("2.8.3.post1", "2.9.1+cu130", "13.0", True, (3, 11))`` ->
    ``flash_attn-2.8.3.post1+cu13torch2.9cxx11abiTRUE-cp311-cp311-linux_x86_64.whl``."""
    torch_minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    cuda_major = torch_cuda.split(".")[0]
    tag = f"cp{python[0]}{python[1]}"
    return (f"flash_attn-{flash_attn_version}+cu{cuda_major}torch{torch_minor}cxx11abi{str(cxx11_abi).upper()}"
            f"-{tag}-{tag}-linux_{machine}.whl")


def wheel_url(flash_attn_version: str) -> str:
    """The release asset address for the installed torch (which must be a CUDA build)."""
    if torch.version.cuda is None:
        raise SystemExit(f"torch {torch.__version__} is not a CUDA build: no flash-attn wheel applies")
    name = wheel_name(flash_attn_version, torch.__version__, torch.version.cuda,
                      bool(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version_info[:2], platform.machine())
    return f"{RELEASES}/v{flash_attn_version}/{name}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="flash-attn release, e.g. 2.8.3.post1")
    print(wheel_url(parser.parse_args(argv).version))


if __name__ == "__main__":
    main()
