"""Attacks by model-written code on the bwrap sandbox: each ends with the expected verdict, and the trainer (this
test process) and the other samples of the batch go on.

The secrets below live where a real job keeps them: the job secret in this process's environment and in a
0600 key file, an ssh key under a home directory, another user's file. The attacks read them by absolute path,
through ``/proc`` and through the environment; none may come back in the output.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import textwrap
import uuid

import pytest

from hpc_rlhf.sandbox.isolation import SandboxUnavailableError, default_python, probe_bwrap
from hpc_rlhf.sandbox.limits import SandboxLimits
from hpc_rlhf.sandbox.local import LocalSandbox
from hpc_rlhf.sandbox.result import ExecRequest

_missing = probe_bwrap(default_python())
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"bubblewrap unusable here: {_missing}")


@pytest.fixture(scope="module")
def sandbox():
    return LocalSandbox("bwrap", limits=SandboxLimits(wall_time_s=5, cpu_time_s=5, memory_mb=512,
                                                      output_bytes=64 * 1024, processes=16), max_workers=4)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """Secrets of the job and of the user, planted on the host; returns the secret text and the paths."""
    secret = "hpc-rlhf-test-secret-" + secrets.token_hex(16)
    monkeypatch.setenv("HPC_RLHF_JOB_SECRET", secret)
    paths = []
    for rel in ("home/.config/hpc_rlhf/store.key", "home/.ssh/id_ed25519", "other_user/notes.txt"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secret)
        path.chmod(0o600)
        paths.append(str(path))
    return secret, paths


def _run(sandbox, code, **kw):
    return sandbox.run(ExecRequest(code=textwrap.dedent(code), **kw))


# An attack that could take the host down if the isolation were missing (kill(-1) as root signals every process
# of the machine; a fork bomb without a process limit) first checks that it runs in a PID namespace other than
# this test's, and otherwise exits without attacking, which fails its test instead of the machine.
_HOST_PID_NS = os.readlink("/proc/self/ns/pid")
_ONLY_IF_ISOLATED = f"""
import os, sys
try:
    _ns = os.readlink("/proc/self/ns/pid")
except OSError:
    _ns = None
if _ns is None or _ns == {_HOST_PID_NS!r}:
    print("ATTACK NOT RUN: same PID namespace as the host")
    sys.exit(0)
"""


def _run_attack(sandbox, code, **kw):
    return _run(sandbox, _ONLY_IF_ISOLATED + textwrap.dedent(code), **kw)


def test_no_network(sandbox):
    result = _run(sandbox, """
        import socket
        for host, port in [("127.0.0.1", 22), ("8.8.8.8", 53), ("pypi.org", 443)]:
            try:
                socket.create_connection((host, port), timeout=2)
                print("CONNECTED", host)
            except OSError as exc:
                print("refused", host, type(exc).__name__)
        print(sorted(name for _, name in socket.if_nameindex()))
    """)
    assert result.status == "ok", result.stderr
    assert "CONNECTED" not in result.stdout
    assert "['lo']" in result.stdout  # a loopback of its own and no other interface


def test_secrets_files_and_environment_are_out_of_reach(sandbox, planted):
    secret, paths = planted
    home = os.path.expanduser("~")
    result = _run(sandbox, f"""
        import os
        print(sorted(os.environ))
        for path in {paths!r} + [{home!r} + "/.ssh", os.path.expanduser("~/.ssh"), "/etc/shadow", "/root"]:
            try:
                print(path, open(path).read() if os.path.isfile(path) else os.listdir(path))
            except OSError as exc:
                print(path, "unreadable", type(exc).__name__)
    """)
    assert result.status == "ok", result.stderr
    assert secret not in result.stdout + result.stderr
    assert "HPC_RLHF_JOB_SECRET" not in result.stdout


def test_proc_of_the_trainer_is_not_visible(sandbox, planted):
    secret, _ = planted
    result = _run(sandbox, f"""
        import os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print("pids", pids)
        for pid in pids + [{os.getpid()}, {os.getppid()}]:
            for name in ("environ", "cmdline"):
                try:
                    print(pid, name, open(f"/proc/{{pid}}/{{name}}", "rb").read())
                except OSError as exc:
                    print(pid, name, type(exc).__name__)
    """)
    assert result.status == "ok", result.stderr
    assert secret not in result.stdout
    visible = eval(result.stdout.splitlines()[0].removeprefix("pids "))  # noqa: S307 - our own print of a list
    assert max(visible) < 10  # its own pid namespace: bwrap's init, prlimit/python, nothing of the host


def test_writes_only_to_the_scratch_dir(sandbox, tmp_path):
    target = tmp_path / "written_by_sandbox"
    result = _run(sandbox, f"""
        import os
        for path in [{str(target)!r}, "/usr/evil", "/etc_evil", "/evil", "/proc/evil"]:
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as exc:
                print("denied", path, type(exc).__name__)
        open("/tmp/mine.txt", "w").write("ok")
        print("scratch", open("mine.txt").read())
    """)
    assert result.status == "ok", result.stderr
    assert "WROTE" not in result.stdout
    assert "scratch ok" in result.stdout
    assert not target.exists()


def test_fork_bomb_is_contained_and_the_trainer_can_still_fork(sandbox):
    result = _run_attack(sandbox, """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, time_limit_s=3)
    assert "ATTACK NOT RUN" not in result.stdout
    assert result.status in ("timeout", "error")
    assert subprocess.run(["true"], check=False).returncode == 0


def test_memory_bomb(sandbox):
    result = _run(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))\n")
    assert result.status == "memory_limit", (result.status, result.stderr[-500:])


def test_infinite_loop_times_out(sandbox):
    result = _run(sandbox, "while True:\n    pass\n", time_limit_s=2)
    assert result.status == "timeout"


def test_sleeping_forever_is_killed_by_the_wall_clock(sandbox):
    result = _run(sandbox, "import time\ntime.sleep(3600)\n", time_limit_s=1)
    assert result.status == "timeout"
    assert result.returncode == -signal.SIGKILL


def test_huge_output_is_capped(sandbox):
    result = _run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert result.status == "output_limit"
    assert len(result.stdout) <= 64 * 1024
    big_file = _run(sandbox, "open('big', 'wb').write(b'x' * (10 * 2**20))\n")
    assert big_file.status == "output_limit"


def test_signals_cannot_reach_the_trainer(sandbox):
    result = _run_attack(sandbox, f"""
        import os, signal
        for pid in (os.getppid(), {os.getpid()}, {os.getppid()}, -1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as exc:
                print(pid, type(exc).__name__)
        os.killpg(0, signal.SIGKILL)
    """)
    assert "ATTACK NOT RUN" not in result.stdout
    assert result.status in ("error", "ok")  # it may kill itself; nothing outside
    assert os.getppid() > 1  # still here, and so is our parent


def test_orphaned_children_die_with_the_sample(sandbox):
    marker = "orphan-" + uuid.uuid4().hex
    result = _run(sandbox, f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
            os._exit(0)
        print("parent exits")
    """)
    assert result.status == "ok", result.stderr
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    survivors.append(pid)
        except OSError:
            continue
    assert survivors == []


def test_the_rest_of_the_batch_goes_on(sandbox):
    attacks = ["import os\nwhile True:\n    os.fork()\n", "x = bytearray(2**34)\n", "while True:\n    pass\n",
               "print('y' * 10**7)\n"]
    benign = [f"print({i} * {i})\n" for i in range(6)]
    requests = [ExecRequest(code=c, time_limit_s=3) for pair in zip(attacks + [""] * 2, benign, strict=True)
                for c in pair if c]
    results = sandbox.run_many(requests)
    outputs = [r.stdout.strip() for r, q in zip(results, requests, strict=True) if q.code.startswith("print(") and
               "*" in q.code and "10**7" not in q.code]
    assert outputs == [str(i * i) for i in range(6)]
    assert all(r.status != "ok" for r, q in zip(results, requests, strict=True) if q.code in attacks)


def test_a_demanded_level_that_is_missing_refuses_to_start(monkeypatch):
    from hpc_rlhf.sandbox import isolation

    isolation.probe_bwrap.cache_clear()
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    try:
        with pytest.raises(SandboxUnavailableError, match="bwrap is not installed"):
            LocalSandbox("bwrap")
        with pytest.raises(SandboxUnavailableError):
            LocalSandbox("auto")
        assert LocalSandbox("rlimits").level == "rlimits"
    finally:
        isolation.probe_bwrap.cache_clear()
