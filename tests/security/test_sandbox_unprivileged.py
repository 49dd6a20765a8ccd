"""The sandbox as an unprivileged user (how users run it; CI runs as root): a child process as ``nobody`` with the
system Python runs a few attacks through ``LocalSandbox``: the job secret, the network, a fork bomb, host files.
Skipped unless this process is root and the system Python, ``runuser`` and bubblewrap are there and this checkout
is readable by ``nobody``. The fork bomb keeps the PID-namespace guard of ``test_sandbox_attacks``: outside a PID
namespace of its own it does not fork at all, and the test fails instead of the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpc_rlhf.sandbox.isolation import default_python, probe_bwrap
from tests.security.test_sandbox_attacks import _ONLY_IF_ISOLATED

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"
SECRET_FILE = Path("/tmp/hpc_rlhf_unpriv_secret")

SCRIPT = r"""
import json, sys
from hpc_rlhf.sandbox.isolation import SandboxUnavailableError
from hpc_rlhf.sandbox.limits import SandboxLimits
from hpc_rlhf.sandbox.local import LocalSandbox
from hpc_rlhf.sandbox.result import ExecRequest
try:
    box = LocalSandbox("bwrap", limits=SandboxLimits(wall_time_s=10, cpu_time_s=5, processes=8), max_workers=2)
except SandboxUnavailableError as err:
    print(json.dumps({"unavailable": str(err)}))
    sys.exit(0)
codes = json.loads(sys.argv[1])
out = {name: box.run(ExecRequest(code=code)).__dict__ for name, code in codes.items()}
out["level"] = box.level
print(json.dumps(out))
"""

CODES = {
    "identity": "import os\nprint(os.getuid(), sorted(os.environ))",
    "secret": f"print(open({str(SECRET_FILE)!r}).read())",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)",
    "fork_bomb": _ONLY_IF_ISOLATED + "import time\nn = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n"
                 "            time.sleep(20)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
                 "        print(n)\n        break",
    "passwd": "print(open('/etc/passwd').read())",
}


def _readable_by_nobody(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path, *path.parents])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to nobody")
@pytest.mark.skipif(not (os.path.exists(SYSTEM_PYTHON) and shutil.which("runuser")),
                    reason="no system python3 or runuser")
@pytest.mark.skipif(probe_bwrap(default_python()) is not None, reason="bubblewrap unavailable")
@pytest.mark.skipif(not _readable_by_nobody(REPO), reason=f"{REPO} is not readable by nobody")
def test_attacks_are_contained_when_run_unprivileged():
    SECRET_FILE.write_text("s3cr3t")
    SECRET_FILE.chmod(0o644)  # readable by nobody on the host: only the sandbox's file system hides it
    try:
        done = subprocess.run([str(shutil.which("runuser")), "-u", "nobody", "--", SYSTEM_PYTHON, "-c", SCRIPT,
                               json.dumps(CODES)], cwd="/tmp", capture_output=True, text=True, timeout=300,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "X": str(SECRET_FILE)})
    finally:
        SECRET_FILE.unlink()
    if done.returncode != 0 and "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"the system python cannot import hpc_rlhf.sandbox: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in out:
        pytest.skip(f"bubblewrap does not run for nobody here: {out['unavailable'][:300]}")
    assert out["level"] == "bwrap"
    uid, env = out["identity"]["stdout"].split(" ", 1)
    assert uid == "65534" and "X" not in env
    assert out["secret"]["status"] == "error" and "s3cr3t" not in out["secret"]["stdout"]
    assert out["network"]["status"] == "error" and "Connection refused" in out["network"]["stderr"]
    assert "ATTACK NOT RUN" not in out["fork_bomb"]["stdout"]
    assert out["fork_bomb"]["status"] == "ok" and int(out["fork_bomb"]["stdout"]) <= 8
    assert "FileNotFoundError" in out["passwd"]["stderr"]
