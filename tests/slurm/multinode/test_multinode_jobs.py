"""Real jobs on the several-node cluster of ``.ci/setup_multinode.sh`` (two nodes, each a network namespace with its
own address and slurmd; node hpcmn1 resolves its own name to 127.0.1.1, as Debian images do).

What these show that one node cannot: ranks on two nodes meet over the nodes' addresses (from the job's own
``world.json``, written from what every rank reported), the time-limit signal and a requeue reach ranks on both
nodes, ``hpc-rlhf submit`` and ``torchrun --nnodes 2`` started by hand work across the network. What they cannot
show: NCCL, InfiniBand, GPUs, real latency (docs/slurm.md, "Several nodes").

The recipe's steps take tens of milliseconds here, so one job of a few hundred steps is cheap; every job writes to a
shared directory (each node's /tmp is its own).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpc_rlhf.world.launch_env import port_from_job_id
from hpc_rlhf.world.sealed_store import SEALED_KEY_PREFIX, SECRET_CHECK_PREFIX

from ..conftest import FINAL, ROOT, read_log, wait_for_state, write_time_limit_job
from .conftest import (
    ADDRESSES,
    NODES,
    OUTSIDER,
    SHARED_ROOT,
    TWO_NODES,
    WatchedJob,
    in_node,
    job_info,
    node_states,
    on_node,
    rank_pids,
    rows,
    sbatch,
    slurm,
    slurm_env,
    wait_for_steps,
    wait_job,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("multinode_cluster")]
STEPS = 300
LONG = [f"train.max_steps={STEPS}", "train.num_episodes=20", "ckpt.save_steps=100"]
COMPARED = ("reward", "score", "response_length", "policy_loss", "actor_grad_norm", "actor_lr")


def _assert_met_over_node_addresses(run: Path, ranks_per_node: int = 1) -> list[dict]:
    """The job's own record (world.json: what each rank reported after init) shows one rank per node, each on the
    node's bridge address and interface, not loopback and not 127.0.1.1."""
    ranks = json.loads((run / "world.json").read_text())["ranks"]
    assert [r["host"] for r in ranks] == [n for n in NODES for _ in range(ranks_per_node)], ranks
    assert [r["address"] for r in ranks] == [ADDRESSES[r["host"]] for r in ranks], ranks
    assert {r["interface"] for r in ranks} == {"eth0"}, ranks
    # derived from the route to the other node, on the node whose name is 127.0.1.1 to itself too
    assert all(r["interface_source"].startswith("route to ") for r in ranks), ranks
    assert [r["local_rank"] for r in ranks] == [i % ranks_per_node for i in range(len(ranks))], ranks
    return ranks


class ReferenceRun:
    """The CPU recipe run through on two nodes, once per module: the run the interrupted ones must reproduce."""

    def __init__(self, folder: Path):
        self.log, self.run = folder / "ref.out", folder / "ref"
        self.job = sbatch("-o", str(self.log), *TWO_NODES, "slurm/cpu_debug.sbatch", *LONG,
                          f"train.output_dir={self.run}")
        self.info: dict[str, str] | None = None

    def finished(self) -> Path:
        """Wait for it (once); return its run folder."""
        if self.info is None:
            self.info = wait_job(self.job, 300, self.log)
            assert self.info["JobState"] == "COMPLETED", read_log(self.log)[-3000:]
        return self.run


@pytest.fixture(scope="module")
def reference_run(multinode_cluster):
    folder = SHARED_ROOT / f"reference-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    reference = ReferenceRun(folder)
    yield reference
    if job_info(reference.job).get("JobState") not in FINAL:
        slurm("scancel", reference.job, check=False)
    shutil.rmtree(folder, ignore_errors=True)


def _assert_same_metrics(run: Path, reference: Path) -> None:
    """The run's metrics equal the reference's, step for step; a step logged twice (before a loss and again after
    the resume) counts with its last value."""
    got = {r["step"]: r for r in rows(run / "metrics.jsonl")}
    want = rows(reference / "metrics.jsonl")
    assert sorted(got) == [r["step"] for r in want]
    for a in want:
        for key in COMPARED:
            assert got[a["step"]][key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_another_users_node_cannot_read_inject_or_join(shared_dir, reference_run):
    """From hpcmnx (a namespace on the same bridge, no part of the job), while the reference job runs: the master
    port is reachable over the network (the job's store listens on every interface), but the stranger lists only
    sealed names, reads nothing in plain text (not even the nodes' addresses the ranks exchange there), its writes
    where torch's keys would be are ignored (the job ends with the same metrics as the preempted run's, compared in
    the next test), and its attempt to join the world as rank 1 is refused."""
    go = shared_dir / "go"
    port = port_from_job_id(reference_run.job)
    stranger = subprocess.Popen(["ip", "netns", "exec", OUTSIDER, sys.executable, str(Path(__file__).parent /
                                 "stranger.py"), NODES[0], str(port), str(go)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = reference_run.run / "metrics.jsonl"
        wait_for_steps(reference_run.job, metrics, reference_run.log, at_least=1, restarts=0)
        go.write_text("go\n")
        out, err = stranger.communicate(timeout=120)
    finally:
        if stranger.poll() is None:
            stranger.kill()
    assert stranger.returncode == 0, err[-3000:]
    seen = json.loads(out.strip().splitlines()[-1])
    print(f"stranger on {OUTSIDER}: {len(seen['keys'])} sealed keys listed, join refused: {seen.get('join_error')}")
    still_running = len(rows(metrics)) < STEPS and job_info(reference_run.job).get("JobState") == "RUNNING"
    assert still_running, "the job ended before the stranger was done: nothing was shown"
    assert seen["keys"], "the stranger did not reach the store"
    assert [key for key in seen["keys"] if not key.startswith((SEALED_KEY_PREFIX, SECRET_CHECK_PREFIX))] == []
    assert not seen["plain_text_seen"], "the store showed the nodes' addresses in plain text"
    assert seen["joined"] is False, seen
    ref_run = reference_run.finished()
    ranks = json.loads((ref_run / "world.json").read_text())["ranks"]
    assert [r["host"] for r in ranks] == list(NODES), ranks


def test_two_node_recipe_learns_exports_and_resumes_exactly_after_preemption(shared_dir, reference_run):
    """Two jobs of the CPU recipe on two nodes at once: one runs through (it learns, checkpoints, exports), the
    other is preempted (USR1 to every rank on both nodes -> one checkpoint -> requeue) and must end with the first
    one's metrics, step for step."""
    log, run = shared_dir / "job.out", shared_dir / "run"
    job = sbatch("-o", str(log), *TWO_NODES, "slurm/cpu_debug.sbatch", *LONG, f"train.output_dir={run}")

    metrics = run / "metrics.jsonl"
    wait_for_steps(job, metrics, log, at_least=3, restarts=0)
    slurm("scancel", "--signal=USR1", job)  # to every task of the job's running steps, on both nodes
    info = wait_job(job, 400, log)
    text = read_log(log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    for rank in (0, 1):  # the signal reached the rank on each node (rank 0's line may follow a progress bar)
        assert re.search(rf"\[rank{rank}\] [^\n]* received SIGUSR1", text), text[-4000:]
    assert f"job {job} restart 1: 2 ranks on hpcmn[1-2]" in text and text.count("resumed from") == 1, text[-4000:]
    assert [r["step"] for r in rows(metrics)] == list(range(1, STEPS + 1))  # nothing lost, nothing repeated
    _assert_met_over_node_addresses(run)  # the restarted world met over the nodes' addresses again

    ref_run = reference_run.finished()
    assert reference_run.info and reference_run.info["NodeList"] == "hpcmn[1-2]"
    _assert_met_over_node_addresses(ref_run)
    want = rows(ref_run / "metrics.jsonl")
    first, last = want[:20], want[-20:]
    assert sum(r["reward"] for r in last) / 20 > sum(r["reward"] for r in first) / 20 + 0.1  # GRPO learns
    assert (ref_run / "ckpt/LATEST").read_text().strip() == f"step_{STEPS}"
    assert (ref_run / "model/config.json").exists() and (ref_run / "model/model.safetensors").exists()
    _assert_same_metrics(run, ref_run)


# A step's watchdog limit in the node-loss test: max(this floor, 4 x the slowest step); steps take ~0.05 s here.
WATCHDOG_S = 10
# docs/reliability.md: a rank that sees no progress for its limit dumps its stacks, waits up to 5 s for its peers'
# dumps and exits 124. The margin covers the dumps and a loaded 2-core machine; a hang would run to the 1800 s
# collective timeout.
EXIT_BOUND_S = WATCHDOG_S + 5 + 45


def _pids_alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def _node_back(node: str) -> None:
    """Link up, node resumed and idle again (for the tests after this one)."""
    subprocess.run(["ip", "link", "set", f"{node}-br", "up"], check=False, timeout=30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = node_states().get(node, "")
        if state.startswith("idle"):
            return
        if state.startswith(("down", "drain", "fail")):
            slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        time.sleep(1)


def test_node_lost_mid_step_and_mid_checkpoint_write(shared_dir, reference_run):
    """hpcmn2's link goes down under two jobs at once: one mid-step, one whose rank on hpcmn2 is inside the write of
    the step-100 checkpoint (held there by the fault hook, hpc_rlhf.resilience.fault_injection). Every rank on both
    sides of the cut ends within the watchdog's bound (no hang); SLURM requeues both when it declares the node down;
    the last complete checkpoint stays LATEST (step_50 for the job cut mid-write); each job, given the node left,
    resumes there on 2 ranks and ends with the uninterrupted run's metrics."""
    reference = reference_run.finished()  # first: the cut would hit it too
    lost = NODES[1]
    faults = shared_dir / "faults"
    faults.mkdir()
    held = faults / "at_checkpoint_write_100_1"
    common = [*LONG, "ckpt.save_steps=50", f"train.watchdog_timeout_s={WATCHDOG_S}",
              f"train.watchdog_checkpoint_s={WATCHDOG_S}"]
    runs = {kind: shared_dir / kind for kind in ("mid_step", "mid_write")}
    logs = {kind: shared_dir / f"{kind}.out" for kind in runs}
    jobs = {
        "mid_step": sbatch("-o", str(logs["mid_step"]), *TWO_NODES, "slurm/cpu_debug.sbatch", *common,
                           f"train.output_dir={runs['mid_step']}"),
        "mid_write": sbatch("-o", str(logs["mid_write"]), *TWO_NODES,
                            f"--export=ALL,HPC_RLHF_FAULT_DIR={faults},HPC_RLHF_FAULT_AT=checkpoint_write:100:1,"
                            "HPC_RLHF_FAULT_WAIT_S=600", "slurm/cpu_debug.sbatch", *common,
                            f"train.output_dir={runs['mid_write']}"),
    }
    infos: dict[str, dict[str, str]] = {}
    try:
        wait_for_steps(jobs["mid_step"], runs["mid_step"] / "metrics.jsonl", logs["mid_step"], 55, restarts=0)
        deadline = time.monotonic() + 240
        while not held.exists():
            assert time.monotonic() < deadline, read_log(logs["mid_write"])[-3000:]
            assert job_info(jobs["mid_write"]).get("JobState") not in FINAL, read_log(logs["mid_write"])[-3000:]
            time.sleep(0.05)
        pids = rank_pids(runs["mid_step"]) + rank_pids(runs["mid_write"])
        assert len(pids) == 4, pids
        assert job_info(jobs["mid_step"]).get("JobState") == "RUNNING"
        cut = time.monotonic()
        subprocess.run(["ip", "link", "set", f"{lost}-br", "down"], check=True, timeout=30)
        while _pids_alive(pids) and time.monotonic() - cut < EXIT_BOUND_S + 60:
            time.sleep(0.2)
        ended_after = time.monotonic() - cut
        assert not _pids_alive(pids), f"ranks {_pids_alive(pids)} still running {ended_after:.0f}s after the cut"
        assert ended_after < EXIT_BOUND_S, f"the ranks took {ended_after:.0f}s to end (bound {EXIT_BOUND_S}s)"

        latest = {}
        for kind, job in jobs.items():
            assert "watchdog: no progress" in read_log(logs[kind]), read_log(logs[kind])[-4000:]
            # SLURM declares the node down (SlurmdTimeout) and requeues the job, which then waits for two nodes
            pending = wait_for_state(job_info, job, "PENDING", logs[kind], 180)
            assert pending["Restarts"] == "1", pending
            latest[kind] = (runs[kind] / "ckpt/LATEST").read_text().strip()
            assert (runs[kind] / "ckpt" / latest[kind] / "layout.json").exists(), latest  # a complete checkpoint
        assert node_states().get(lost, "").startswith(("down", "idle*", "fail")), node_states()
        assert latest["mid_write"] == "step_50", latest  # the cut step-100 write never became LATEST
        logged = [r["step"] for r in rows(runs["mid_step"] / "metrics.jsonl")]
        assert latest["mid_step"] == f"step_{max(logged) // 50 * 50}" or \
            latest["mid_step"] == f"step_{max(logged) // 50 * 50 - 50}", (latest, max(logged))

        # the operator gives each job the node that is left: 2 ranks on hpcmn1 (the same data-parallel size)
        for job in jobs.values():
            slurm("scontrol", "update", f"JobId={job}", "NumTasks=2", "TasksPerNode=2", "NumCPUs=2",
                  f"ExcNodeList={lost}")
            # slurmctld sometimes keeps the job's 2 nodes right after a requeue (the update returns 0): until it
            # takes, ask again
            deadline = time.monotonic() + 60
            while (info := job_info(job)).get("NumNodes") != "1" and info.get("NodeList") != NODES[0]:
                assert time.monotonic() < deadline, info
                slurm("scontrol", "update", f"JobId={job}", "NumNodes=1")
                time.sleep(1)
        # the link comes back while they run (they exclude the node): it rejoins by the time they end
        subprocess.run(["ip", "link", "set", f"{lost}-br", "up"], check=True, timeout=30)
        infos = {kind: wait_job(job, 300, logs[kind]) for kind, job in jobs.items()}
    finally:
        for job in jobs.values():
            if job_info(job).get("JobState") not in FINAL:
                slurm("scancel", job, check=False)
        _node_back(lost)
    print(f"node loss: every rank of both jobs ended {ended_after:.1f}s after the cut (bound {EXIT_BOUND_S}s)")
    for kind, job in jobs.items():
        text = read_log(logs[kind])
        assert infos[kind]["JobState"] == "COMPLETED" and infos[kind]["NodeList"] == NODES[0], text[-4000:]
        assert f"job {job} restart 1: 2 ranks on {NODES[0]}" in text, text[-4000:]
        step = int(latest[kind].removeprefix("step_"))
        assert f"resumed from {runs[kind] / 'ckpt' / latest[kind]} (step {step})" in text, text[-4000:]
        ranks = json.loads((runs[kind] / "world.json").read_text())["ranks"]
        assert [r["host"] for r in ranks] == [NODES[0], NODES[0]] and [r["local_rank"] for r in ranks] == [0, 1]
        _assert_same_metrics(runs[kind], reference)


@pytest.fixture(scope="module", autouse=True)
def time_limit_job(multinode_cluster):
    """The time-limit job (``write_time_limit_job``) on both nodes: submitted before the module's first test, so
    that its wait runs beside the other jobs instead of after them."""
    folder = SHARED_ROOT / f"time-limit-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    log = folder / "sig.out"
    job = WatchedJob(sbatch("-o", str(log), *TWO_NODES, str(write_time_limit_job(folder))), log, timeout_s=150)
    yield job
    job.cancel()
    shutil.rmtree(folder, ignore_errors=True)


def test_time_limit_signal_reaches_every_rank_on_every_node(time_limit_job):
    """--signal=USR1@45 with --time=1: the scheduler signals the step's tasks on both nodes, not the batch shell."""
    info = time_limit_job.result()
    text = read_log(time_limit_job.log)
    assert info["JobState"] == "COMPLETED", text
    assert "task 0 on hpcmn1 got USR1" in text and "task 1 on hpcmn2 got USR1" in text, text
    assert "batch shell got USR1" not in text and "batch done" in text


def test_submit_from_the_login_namespace_runs_on_two_nodes(shared_dir):
    """`hpc-rlhf submit` (submitit) from the root namespace, which is no node of the cluster."""
    run = shared_dir / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hpc_rlhf.cli.submit", "--config", "configs/grpo_tiny_cpu.yaml",
         "--partition", "nodes", "--nodes", "2", "--gpus-per-node", "0", "--tasks-per-node", "1",
         "--time", "00:20:00", "--wait", "train.max_steps=4", f"train.output_dir={run}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=slurm_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [1, 2, 3, 4]
    _assert_met_over_node_addresses(run)
    assert (run / "model/config.json").exists()


def test_torchrun_started_by_hand_on_two_nodes(shared_dir):
    """`torchrun --nnodes 2` typed on each node by a user logged in there, with the first node's name as the master
    (which that node resolves to 127.0.1.1 itself): the ranks meet over the nodes' addresses."""
    run = shared_dir / "run"
    subprocess.run([sys.executable, "-c", "import sys; from hpc_rlhf.cli.startup import prepare_local_assets; "
                    "from hpc_rlhf.config import load_config; "
                    "prepare_local_assets(load_config('configs/grpo_tiny_cpu.yaml', []))"],
                   cwd=ROOT, check=True, timeout=300)
    port = "29631"
    procs = []
    for node_rank, node in enumerate(NODES):
        cmd = [*on_node(node), f"--wd={ROOT}", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--master-addr", NODES[0], "--master-port", port,
               "-m", "hpc_rlhf.cli.train_ppo", "--config", "configs/grpo_tiny_cpu.yaml", "train.max_steps=3",
               f"train.output_dir={run}", "train.collective_timeout_s=120"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [1, 2, 3]
    _assert_met_over_node_addresses(run)


def test_the_node_resolves_its_own_name_to_127_0_1_1():
    """The premise of the tests above: on hpcmn1 its own name is 127.0.1.1 (Debian), elsewhere its address."""
    assert in_node(NODES[0], "getent", "hosts", NODES[0]).stdout.split()[0] == "127.0.1.1"
    assert in_node(NODES[1], "getent", "hosts", NODES[0]).stdout.split()[0] == ADDRESSES[NODES[0]]
    assert in_node(NODES[1], "hostname").stdout.strip() == NODES[1]


def test_each_node_has_its_own_tmp_run_and_spool():
    """Node-local state: a file a node writes into its /tmp, /run or slurmd spool, the other node and the login node
    do not see (each node mounts its own; the slurmd spool path is the same on every node, as on a cluster)."""
    name = f"hpc-rlhf-node-local-{uuid.uuid4().hex[:8]}"
    for folder in ("/tmp", "/run", "/var/spool/slurmd-multinode"):
        path = f"{folder}/{name}"
        assert in_node(NODES[0], "touch", path).returncode == 0, path
        try:
            assert in_node(NODES[0], "test", "-e", path).returncode == 0, path
            assert in_node(NODES[1], "test", "-e", path).returncode == 1, f"{NODES[1]} sees {NODES[0]}'s {path}"
            assert not Path(path).exists(), f"the login node sees {NODES[0]}'s {path}"
        finally:
            in_node(NODES[0], "rm", "-f", path)


def test_controller_traffic_across_the_nodes(shared_dir):
    """benchmarks/controller_traffic.py with one rank per node (srun): every message rank 0 sends crosses the link,
    and the bytes equal the model `plan` uses (hpc_rlhf.world.traffic; the table's `model` column)."""
    log = shared_dir / "traffic.out"
    script = shared_dir / "traffic.sbatch"
    script.write_text("#!/bin/bash\n"
                      f"srun --kill-on-bad-exit=1 {sys.executable} benchmarks/controller_traffic.py --layouts dp "
                      "--samples 16 --prompt-len 16 --response-len 32 --repeats 2\n")
    job = sbatch("-o", str(log), *TWO_NODES, str(script))
    info = wait_job(job, 180, log)
    text = read_log(log)
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert "2 gloo ranks on hpcmn1, hpcmn2" in text, text
    rows = [line for line in text.splitlines() if line.startswith("| dp |")]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("yes") for row in rows), text
    print("\n".join(line for line in text.splitlines() if line.startswith("|") or "gloo ranks" in line))


def test_another_users_node_cannot_use_the_reward_server(shared_dir):
    """`hpc-rlhf serve-rm --host 0.0.0.0` on hpcmn1 with its key in the environment: a rank on hpcmn2 holding the
    key is served; another user's node (hpcmnx) reaches the port but gets 401 without the key or with a wrong one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tiny = ROOT / "runs/models/tiny-char-llama"
    if not (tiny / "config.json").exists():
        pytest.skip("the CPU recipe's tiny model is built by the jobs above (runs/models/tiny-char-llama)")
    rm_dir = shared_dir / "rm"
    rm = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    rm.config.pad_token_id = rm.config.eos_token_id
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(rm_dir)
    key, port = uuid.uuid4().hex, 29711
    url = f"http://{ADDRESSES[NODES[0]]}:{port}/get_reward"
    # nsenter execs the server (no fork): this Popen's pid is the server's, stopped by that pid below
    server = subprocess.Popen([*on_node(NODES[0]), f"--wd={ROOT}", sys.executable, "-m",
                               "hpc_rlhf.cli.serve_rm", "--reward_pretrain", str(rm_dir), "--host", "0.0.0.0",
                               "--port", str(port), "--max_len", "32"],
                              env={**slurm_env(), "HPC_RLHF_RM_API_KEY": key}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    probe = str(Path(__file__).parent / "probe_http.py")

    def ask(where: list[str], *key_arg: str) -> dict:
        out = subprocess.run([*where, sys.executable, probe, url, *key_arg], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    rank_node = on_node(NODES[1])
    outsider = ["ip", "netns", "exec", OUTSIDER]
    try:
        deadline = time.monotonic() + 120
        while (served := ask(rank_node, key))["status"] != 200:
            assert server.poll() is None and time.monotonic() < deadline, served
            time.sleep(1)
        without, wrong = ask(outsider), ask(outsider, "not-the-key")
    finally:
        server.terminate()
        try:
            server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    assert '"rewards"' in served["body"], served
    assert without["status"] == 401 and "missing or wrong API key" in without["body"], without
    assert wrong["status"] == 401, wrong
    print(f"reward server on {NODES[0]}: {OUTSIDER} without the key -> {without['status']}, wrong key -> "
          f"{wrong['status']}; {NODES[1]} with the key -> {served['status']}")
