"""``import hpc_rlhf.algos`` stays light: torch only, no distributed runtime."""

import os
import pathlib
import re
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
import sys
HEAVY = ('deepspeed', 'vllm', 'flash_attn', 'transformers', 'ray')
attempted = []

class RecordHeavyImports:
    # Records even guarded attempts (try: import deepspeed) on machines where it is absent.
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in HEAVY:
            attempted.append(name)
        return None

sys.meta_path.insert(0, RecordHeavyImports())
import hpc_rlhf.algos
import torch.distributed as dist
loaded = sorted(m for m in sys.modules if m.split('.')[0] in HEAVY)
print('HEAVY', loaded + attempted)
print('INITIALIZED', dist.is_available() and dist.is_initialized())
"""


def test_import_algos_pulls_no_heavy_runtime():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout
    assert "INITIALIZED False" in result.stdout, result.stdout


def test_algos_source_never_calls_torch_distributed():
    forbidden = re.compile(
        r"^\s*(import|from)\s+(torch\.distributed|deepspeed|vllm|flash_attn)\b"
        r"|torch\.distributed\.\w+\(|\bdist\.\w+\(",
        re.MULTILINE,
    )
    sources = sorted((REPO_ROOT / "hpc_rlhf" / "algos").glob("*.py"))
    assert sources
    for path in sources:
        assert not forbidden.search(path.read_text()), path
