import os
import re
import socket
import stat
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_rlhf.world.job_secret import (
    JOB_SECRET_ENV,
    USER_KEY_FILE_ENV,
    JobSecretError,
    held_job_secret,
    job_secret,
)
from hpc_rlhf.world.launch_env import (
    LINUX_DEFAULT_EPHEMERAL_RANGE,
    PORT_CEILING,
    PORT_FLOOR,
    LaunchEnvError,
    MasterPortInUseError,
    detect_launch_env,
    ephemeral_port_range,
    expand_nodelist,
    free_port,
    listen_on_master_port,
    port_from_job_id,
)


@pytest.mark.parametrize(
    "nodelist,expected",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("rack-[1-2]-n[08-09]", ["rack-1-n08", "rack-1-n09", "rack-2-n08", "rack-2-n09"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ],
)
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


def test_bad_nodelist_is_named():
    with pytest.raises(LaunchEnvError, match=r"gpu\[01-"):
        expand_nodelist("gpu[01-")


def _slurm(**extra):
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
    }
    env.update(extra)
    return env


def test_slurm_step():
    e = detect_launch_env(_slurm())
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.local_world_size) == ("slurm", 5, 8, 1, 2)
    assert e.master_addr == "gpu07" and e.num_nodes == 4 and e.node_rank == 1
    assert e.master_port == port_from_job_id("123456") and e.master_port_from == "job id 123456"


def test_every_rank_derives_the_same_master():
    envs = [detect_launch_env(_slurm(SLURM_PROCID=str(r), SLURM_LOCALID=str(r % 2), SLURM_NODEID=str(r // 2)))
            for r in range(8)]
    assert len({(e.master_addr, e.master_port) for e in envs}) == 1
    assert [e.rank for e in envs] == list(range(8))


def test_uneven_tasks_per_node():
    e = detect_launch_env(_slurm(SLURM_STEP_TASKS_PER_NODE="3(x2),2", SLURM_STEP_NUM_TASKS="8",
                                 SLURM_JOB_NODELIST="n[1-3]", SLURM_NODEID="2", SLURM_PROCID="7",
                                 SLURM_LOCALID="1"))
    assert e.local_world_size == 2 and e.num_nodes == 3


def test_master_port_override_and_missing_job_id():
    assert detect_launch_env(_slurm(MASTER_PORT="29999")).master_port == 29999
    env = _slurm()
    del env["SLURM_JOB_ID"]
    with pytest.raises(LaunchEnvError, match="MASTER_PORT"):
        detect_launch_env(env)


def test_batch_script_without_srun_is_single_process():
    env = _slurm()
    del env["SLURM_STEP_ID"]
    assert detect_launch_env(env).launcher == "single"


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"SLURM_PROCID": "8"}, "rank 8 is outside"),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({"SLURM_LOCALID": "3"}, "local rank 3"),
        ({"SLURM_NODEID": "9", "SLURM_STEP_TASKS_PER_NODE": "2(x10)"}, "SLURM_NODEID=9"),
        ({"SLURM_NODEID": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, r"node id 3 has no entry in .*'2\(x3\)'"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x4"}, r"cannot parse SLURM tasks-per-node '2\(x4'"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2x4"}, "cannot parse SLURM tasks-per-node '2x4'"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x2),,2"}, "cannot parse SLURM tasks-per-node"),
    ],
)
def test_inconsistent_slurm(bad, match):
    with pytest.raises(LaunchEnvError, match=match):
        detect_launch_env(_slurm(**bad))


def test_missing_slurm_nodelist():
    env = _slurm()
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(LaunchEnvError, match="SLURM_JOB_NODELIST"):
        detect_launch_env(env)


def test_torchrun_wins_inside_srun():
    env = _slurm(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4", MASTER_ADDR="h", MASTER_PORT="1234")
    e = detect_launch_env(env)
    assert (e.launcher, e.rank, e.world_size, e.master_addr, e.master_port) == ("torchrun", 3, 4, "h", 1234)


def test_torchrun_missing_master():
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(LaunchEnvError, match="RANK is not set"):
        detect_launch_env({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_openmpi():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    e = detect_launch_env(env)
    assert (e.launcher, e.rank, e.world_size, e.master_addr) == ("mpi", 1, 2, "127.0.0.1")
    multi = dict(env, OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0")
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        detect_launch_env(multi)


def test_single_process():
    e = detect_launch_env({})
    assert (e.launcher, e.rank, e.world_size, e.local_rank) == ("single", 0, 1, 0)
    assert 0 < e.master_port < 65536


def test_export_sets_env_vars():
    env = {}
    detect_launch_env(_slurm()).export(env)
    assert env == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(port_from_job_id("123456")), "RANK": "5",
                   "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


# ------------------------------------------------------------------------------ master port from the job id
def test_the_old_formula_put_a_third_of_jobs_in_the_ephemeral_range_and_the_new_one_none():
    """20000 + id % 20000 lands in Linux's default ephemeral range 32768-60999 for ids ending in 12768..19999 (mod
    20000): such a job could fail with EADDRINUSE because some process's outgoing connection held its port."""
    first, last = LINUX_DEFAULT_EPHEMERAL_RANGE
    ids = range(100_000, 120_000)
    assert sum(first <= 20000 + i % 20000 <= last for i in ids) == 7232  # the old formula: 36% of ids
    ports = [port_from_job_id(str(i), LINUX_DEFAULT_EPHEMERAL_RANGE) for i in ids]
    assert not any(first <= port <= last for port in ports)
    assert min(ports) >= PORT_FLOOR and max(ports) <= PORT_CEILING
    assert len(set(ports)) == 65536 - PORT_FLOOR - (last - first + 1)  # every candidate is used: 17304 ports


@given(job=st.integers(0, 10**12), first=st.integers(1024, 60000), width=st.integers(0, 30000))
def test_a_derived_port_is_never_in_the_ephemeral_range(job, first, width):
    last = min(first + width, PORT_CEILING)
    try:
        port = port_from_job_id(str(job), (first, last))
    except LaunchEnvError as err:  # the range leaves too few ports: said, naming it
        assert f"{first}-{last}" in str(err) and "MASTER_PORT" in str(err)
        return
    assert not first <= port <= last and PORT_FLOOR <= port <= PORT_CEILING
    assert port == port_from_job_id(f"job-{job}", (first, last))  # deterministic, digits only


def test_the_ephemeral_range_is_read_from_the_node(tmp_path):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("20000\t50000\n")
    assert ephemeral_port_range(range_file) == (20000, 50000)
    assert ephemeral_port_range(tmp_path / "missing") == LINUX_DEFAULT_EPHEMERAL_RANGE
    range_file.write_text("garbage\n")
    assert ephemeral_port_range(range_file) == LINUX_DEFAULT_EPHEMERAL_RANGE
    # With this node's range 20000-50000 every job maps above it.
    assert all(port_from_job_id(str(i), (20000, 50000)) > 50000 for i in range(0, 40000, 7))


def test_this_nodes_range_is_the_one_used():
    first, last = ephemeral_port_range()
    assert detect_launch_env(_slurm()).master_port == port_from_job_id("123456", (first, last))
    assert not first <= detect_launch_env(_slurm()).master_port <= last


def test_a_port_in_use_is_named_with_the_way_out():
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(port)})
        with pytest.raises(MasterPortInUseError, match=rf"master port {port} \(from MASTER_PORT\) is already in use"
                           r".*EADDRINUSE.*export MASTER_PORT="):
            listen_on_master_port(env)


def test_a_local_run_listens_on_loopback_only():
    port = free_port()
    env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port)})
    with listen_on_master_port(env) as listener:
        assert socket.getaddrinfo("localhost", port)[0][4][0] == listener.getsockname()[0]
    # A job on several nodes listens everywhere: a node name may resolve to loopback on the node itself only.
    multi = detect_launch_env({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
                               "MASTER_PORT": str(port)})
    with listen_on_master_port(multi) as listener:
        assert listener.getsockname()[0] in ("0.0.0.0", "::")
    with listen_on_master_port(env) as listener:
        # Another address of this machine is not listened on (where it has one besides loopback).
        others = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, family=socket.AF_INET)}
        for address in others - {"127.0.0.1", "127.0.1.1"}:
            with socket.socket() as probe, pytest.raises(OSError):  # refused (or dropped: a timeout)
                probe.settimeout(2)
                probe.connect((address, port))


# ------------------------------------------------------------------------------ the job's secret
def _torchrun(port="29400", run_id="r1"):
    return detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                              "TORCHELASTIC_RUN_ID": run_id})


def test_a_given_secret_is_used_and_taken_out_of_the_environment():
    environ = {JOB_SECRET_ENV: "s" * 64, "PATH": "/bin"}
    assert job_secret(_torchrun(), environ) == "s" * 64
    assert environ == {"PATH": "/bin"}  # the processes this rank starts do not inherit it
    handed = {JOB_SECRET_ENV: "h" * 64}
    assert held_job_secret(handed) == "h" * 64 and handed == {}
    with pytest.raises(JobSecretError, match="fewer than 32"):
        job_secret(_torchrun(), {JOB_SECRET_ENV: "short"})
    with pytest.raises(JobSecretError, match="not set"):
        held_job_secret({})


def test_without_one_every_rank_derives_the_same_secret_from_a_private_key_file(tmp_path):
    key_file = tmp_path / "cfg" / "store.key"
    environ = {USER_KEY_FILE_ENV: str(key_file)}
    secret = job_secret(_torchrun(), environ)
    assert JOB_SECRET_ENV not in environ and len(secret) == 64
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    # Another rank of the same job (same identity) agrees; another job does not.
    assert job_secret(_torchrun(), {USER_KEY_FILE_ENV: str(key_file)}) == secret
    assert job_secret(_torchrun(run_id="r2"), {USER_KEY_FILE_ENV: str(key_file)}) != secret
    assert job_secret(_torchrun(port="29401"), {USER_KEY_FILE_ENV: str(key_file)}) != secret
    # Another user's key gives another secret.
    other = tmp_path / "other.key"
    other.write_text("b" * 64)
    os.chmod(other, 0o600)
    assert job_secret(_torchrun(), {USER_KEY_FILE_ENV: str(other)}) != secret


def test_a_key_file_others_can_read_is_refused(tmp_path):
    key_file = tmp_path / "store.key"
    key_file.write_text("k" * 64)
    os.chmod(key_file, 0o644)
    with pytest.raises(JobSecretError, match=r"mode -rw-r--r--.*chmod 600"):
        job_secret(_torchrun(), {USER_KEY_FILE_ENV: str(key_file)})


def test_a_submitted_job_generates_a_fresh_secret_in_its_batch_script():
    """The line ``hpc-rlhf submit`` adds to the sbatch script before srun: 64 hex characters, new at every run."""
    from hpc_rlhf.cli.submit import JOB_SECRET_SETUP

    def run() -> str:
        return subprocess.run(["bash", "-c", f"{JOB_SECRET_SETUP}; printf %s \"${JOB_SECRET_ENV}\""],
                              capture_output=True, text=True, check=True).stdout

    first, second = run(), run()
    assert re.fullmatch(r"[0-9a-f]{64}", first) and first != second


def test_the_launch_round_counts_requeues_and_torchrun_restarts():
    base = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    assert detect_launch_env(base).launch_round == "0.0"
    assert detect_launch_env({**base, "SLURM_RESTART_COUNT": "2"}).launch_round == "2.0"
    assert detect_launch_env({**base, "TORCHELASTIC_RESTART_COUNT": "1"}).launch_round == "0.1"
    with pytest.raises(LaunchEnvError, match="SLURM_RESTART_COUNT"):
        detect_launch_env({**base, "SLURM_RESTART_COUNT": "x"})
