import pytest

from hpc_rlhf.world.launch_env import LaunchEnvError, detect_launch_env, expand_nodelist, port_from_job_id


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
    assert e.master_port == port_from_job_id("123456") == 20000 + 123456 % 20000


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
