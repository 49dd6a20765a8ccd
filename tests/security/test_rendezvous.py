"""Attacks on the job's rendezvous stores, on loopback, by a stranger: a client that knows the port (from the job id
in ``squeue``, or by scanning) but not the job's secret.

What it proves, each against the real components (``init_world``, the gloo weight channel, a GRPO run):
- a second client on the world's store lists only sealed names, cannot read a value the job wrote, and its writes
  under the names torch uses are ignored; a value it moves or forges is refused with an error, not used;
- it cannot take a rank of the world or of a weight channel (before sealing it could, and received the job's
  broadcasts: the controller's pickled objects, the actor's weights);
- a job trains while such a client reads, lists and writes the store all through its start-up and steps.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d as c10d

from hpc_rlhf.utils.metrics import read_metrics
from hpc_rlhf.weight_sync.vllm_gloo_transfer import GlooGroup, GlooSenderChannel
from hpc_rlhf.world.job_secret import JOB_SECRET_ENV, JobSecretError
from hpc_rlhf.world.launch_env import free_port
from hpc_rlhf.world.sealed_store import (
    SEALED_KEY_PREFIX,
    SECRET_CHECK_PREFIX,
    SealedStore,
    StoreTamperedError,
    sealed_tcp_store,
)
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks
from tests.security.waits import join_or_fail, spawn_or_fail

pytestmark = [pytest.mark.security, pytest.mark.slow]

PAYLOAD = b"job-private payload 7f3a"
TIMEOUT = datetime.timedelta(seconds=60)
# How long a stranger's join attempt (and the job's wait for it) may take before it counts as refused.
JOIN_TIMEOUT_S = 6
# The names torch itself gives the world's rendezvous keys on an unsealed store (gloo: each rank's address, per
# group and device), which a stranger would overwrite to redirect or break the job.
TORCH_KEY_GUESSES = [f"default_pg/{group}//{sub}cpu//0/{rank}" for group in range(4) for sub in ("", "1//")
                     for rank in range(2)] + ["0//marker", "default_pg/0//marker", "marker"]


def _stranger(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))


def _is_sealed(name: str) -> bool:
    return name.startswith((SEALED_KEY_PREFIX, SECRET_CHECK_PREFIX))


# ------------------------------------------------------------------ the world's store: read, write, forge
def _world_under_attack(rank: int, world_size: int) -> dict:
    store = c10d._get_default_store()  # what torch's own keys go through
    if rank == 0:
        store.set("marker", PAYLOAD)
    dist.barrier()
    result: dict = {}
    if rank == 0:
        stranger = _stranger(int(os.environ["MASTER_PORT"]))
        keys = stranger.list_keys()
        values = [stranger.get(key) for key in keys]
        result.update(keys=keys, payload_seen=any(PAYLOAD in value for value in values))
        for name in TORCH_KEY_GUESSES:  # blind writes where torch's keys would be
            stranger.set(name, b"forged")
        result["read_back"] = store.get("marker")
    dist.barrier()
    group = dist.new_group([0, 1])  # a rendezvous through the store after the writes
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=group)
    result["sum"] = total.item()
    dist.barrier()
    if rank == 0:  # now move each sealed value to another sealed key: the job must refuse, not use, them
        sealed = sorted(key for key in stranger.list_keys() if key.startswith(SEALED_KEY_PREFIX))
        moved = [stranger.get(key) for key in sealed]
        for key, value in zip(sealed, moved[1:] + moved[:1], strict=True):
            stranger.set(key, value)
        try:
            result["tampered"] = repr(store.get("marker"))
        except StoreTamperedError as err:
            result["tampered"] = str(err)
    return result


def test_a_second_client_can_neither_read_nor_change_the_worlds_keys():
    results = run_on_ranks(_world_under_attack, 2)
    seen = results[0]
    assert seen["keys"], "the stranger reached the store"
    assert [key for key in seen["keys"] if not _is_sealed(key)] == [], "names torch uses are listed"
    assert not seen["payload_seen"], "a value the job wrote was readable"
    assert seen["read_back"] == PAYLOAD, "a blind write under the plain name replaced the job's value"
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert "marker'" in seen["tampered"] and "was not written by this job" in seen["tampered"]


# ------------------------------------------------------------------ the world: a stranger takes rank 1
# The job's rank 0 waits this long for its own rank 1 (which comes once the stranger gave up).
WORLD_WAIT_S = 60


def _init_job_rank(rank: int, port: int, timeout_s: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from hpc_rlhf.world.groups import init_world

    init_world(timeout_s=timeout_s, backend="gloo")


def _receive_broadcast(results, index: int, payload: bytes | None) -> None:
    box = [payload]
    dist.broadcast_object_list(box, src=0)  # the controller's channel works this way
    results[index] = ("joined", box[0])


def _stranger_entry(port: int, results) -> None:
    """Two tries at rank 1: with this project's own init_world and a secret of the stranger's (what any user of the
    cluster has installed), then the way torch's tcp:// rendezvous joins (what any user can run). In this order:
    a failed ``init_process_group`` moves torch's group counter, and a later try in the process would then wait
    under other key names than the job's."""
    time.sleep(1)  # rank 0 is listening
    refusals = []
    os.environ[JOB_SECRET_ENV] = "s" * 64
    try:
        _init_job_rank(1, port, JOIN_TIMEOUT_S)
        return _receive_broadcast(results, 1, None)
    except Exception as err:  # noqa: BLE001 - the outcome is the test's
        refusals.append(f"init_world: {type(err).__name__}: {err}"[:300])
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        return _receive_broadcast(results, 1, None)
    except Exception as err:  # noqa: BLE001
        refusals.append(f"tcp://: {type(err).__name__}: {err}"[:300])
    results[1] = ("refused", " | ".join(refusals))


def _join_entry(index: int, port: int, results) -> None:
    """index 0: the job's rank 0 (of 2) through init_world; index 1: the stranger (``_stranger_entry``); index 2:
    the job's own rank 1 through init_world, once the stranger has had its go (so a world that forms for nobody,
    e.g. a broken init_world, fails the test too)."""
    try:
        if index == 1:
            return _stranger_entry(port, results)
        if index == 2:
            deadline = time.monotonic() + 2 * JOIN_TIMEOUT_S + 30
            while 1 not in results.keys():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the stranger's tries did not end within {2 * JOIN_TIMEOUT_S + 30} s")
                time.sleep(0.2)
        _init_job_rank(index // 2, port, WORLD_WAIT_S)
        _receive_broadcast(results, index, PAYLOAD if index == 0 else None)
    except Exception as err:  # noqa: BLE001 - the outcome is the test's
        results[index] = ("refused", f"{type(err).__name__}: {err}"[:300])


def test_a_stranger_cannot_take_a_rank_of_the_world():
    results = mp.Manager().dict()
    spawn_or_fail(_join_entry, (free_port(), results), 3, WORLD_WAIT_S + 4 * JOIN_TIMEOUT_S + 120,
                  "the job's ranks and the stranger", results)
    job, stranger, own_rank = results.get(0), results.get(1), results.get(2)
    assert stranger is not None and stranger[0] == "refused", f"the stranger took rank 1: {stranger}"
    assert PAYLOAD.decode() not in str(stranger), f"the stranger received the job's broadcast: {stranger}"
    assert job == ("joined", PAYLOAD), f"the job's rank 0 did not form its world with its own rank 1: {job}"
    assert own_rank == ("joined", PAYLOAD), f"the job's own rank 1 did not join after the stranger: {own_rank}"


# ------------------------------------------------------------------ a weight channel
def test_a_stranger_can_neither_join_a_weight_channel_nor_read_its_store(monkeypatch):
    """The gloo weight channel (actor -> vLLM workers): a stranger tries rank 1 first, the way the channel joined
    before sealing (plain TCPStore + PrefixStore), then with a secret of its own; the job's worker joins after it."""
    monkeypatch.setenv(JOB_SECRET_ENV, "j" * 64)
    channel = GlooSenderChannel(num_workers=1, timeout_s=60)  # the store is bound from here on
    port, name = channel.rendezvous["master_port"], channel.rendezvous["channel"]
    bucket = torch.arange(12, dtype=torch.float32)
    outcome: dict = {}
    timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)

    def stranger() -> None:
        try:
            store = dist.PrefixStore("hpc_rlhf_weight_transfer", _stranger(port))
            group = dist.ProcessGroupGloo(store, 1, 2, timeout)
            received = torch.zeros(12)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([received], options).wait()
            outcome["stranger"] = ("joined", received)
        except Exception as err:  # noqa: BLE001
            outcome["stranger"] = ("refused", str(err))
        try:
            sealed_tcp_store("127.0.0.1", port, rank=1, world_size=2, secret="s" * 64,
                             namespace=f"weight_transfer/{name}", timeout=timeout)
            outcome["own_secret"] = "joined"
        except JobSecretError as err:
            outcome["own_secret"] = str(err)
        outcome["keys"] = _stranger(port).list_keys()

    def worker() -> None:
        attacker.join(90)  # only once the stranger has had its go (the test fails if it has not ended)
        group = GlooGroup("127.0.0.1", port, rank=1, world_size=2, timeout_s=60, channel=name)
        group.connect()
        received = torch.zeros(12)
        group.broadcast(received, src=0)
        outcome["worker"] = received
        group.close()

    attacker, receiver = threading.Thread(target=stranger), threading.Thread(target=worker)
    attacker.start()
    receiver.start()
    channel.connect()
    channel.send([("w", bucket)])
    join_or_fail(receiver, 120, "the job's worker joining the weight channel")
    join_or_fail(attacker, 30, "the stranger's tries at the weight channel")
    channel.close()
    assert outcome["stranger"][0] == "refused", "the stranger joined the channel and would receive the weights"
    assert "differs from the one rank 0 published" in outcome["own_secret"]
    assert torch.equal(outcome["worker"], bucket)
    assert outcome["keys"] and all(_is_sealed(k) or k.startswith("hpc_rlhf_weight_transfer") for k in outcome["keys"])


# ------------------------------------------------------------------ a job trains beside a stranger
def _keep_attacking(port: int, stop, report) -> None:
    """List, read and write the store as fast as it can, from before the job's rendezvous to its end; never deletes
    or moves the job's sealed keys (that is denial of service, which sealing does not prevent)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            stranger = _stranger(port)
            break
        except Exception:  # noqa: BLE001 - the job's rank 0 is not listening yet
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
    plain_names, rounds, values_read = set(), 0, 0
    ours = set(TORCH_KEY_GUESSES) | {"init/"}
    while not stop.is_set():
        try:
            for key in stranger.list_keys():
                if not _is_sealed(key) and key not in ours:
                    plain_names.add(key)
                values_read += len(stranger.get(key)) > 0
            for name in TORCH_KEY_GUESSES:
                stranger.set(name, b"forged")
            stranger.add("init/", 1)
            rounds += 1
        except Exception:  # noqa: BLE001 - the store closed: the job ended
            break
        time.sleep(0.01)
    report.update(rounds=rounds, plain_names=sorted(plain_names), values_read=values_read)


def _train_entry(rank: int, port: int, overrides: list[str], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from hpc_rlhf.world.groups import init_world

    init_world(timeout_s=300, backend="gloo")
    run_trainer(rank, 2, overrides).fit()
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = "done"


def test_a_job_trains_while_a_stranger_reads_and_writes_its_store(tmp_path):
    assets = make_assets(tmp_path / "assets")
    port = free_port()
    manager = mp.Manager()
    stop, report, results = manager.Event(), manager.dict(), manager.dict()
    attacker = mp.get_context("spawn").Process(target=_keep_attacking, args=(port, stop, report))
    attacker.start()
    try:
        spawn_or_fail(_train_entry, (port, grpo_overrides(assets, tmp_path / "run", "train.max_steps=2"), results), 2,
                      450, "a 2-step GRPO run beside the stranger", results)
    finally:
        stop.set()
        attacker.join(timeout=30)
    assert dict(results) == {0: "done", 1: "done"}
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2]
    assert report["rounds"] > 0 and report["values_read"] > 0, dict(report)  # it was there, reading
    assert report["plain_names"] == [], "the stranger saw names torch uses"


# ------------------------------------------------------------------ counters over sealed values
def test_counters_and_compare_set_work_over_sealed_values_and_refuse_a_forged_one():
    """torch's store-based barriers count with ``add``; over sealed values it is a compare-and-swap loop. Two of the
    job's clients count together; a counter the stranger overwrote is refused, not added to."""
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    first, second = (SealedStore(_stranger(port), "c" * 64, "world") for _ in range(2))
    threads = [threading.Thread(target=lambda s=s: [s.add("barrier", 1) for _ in range(50)]) for s in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        join_or_fail(thread, 60, "a client counting over sealed values")
    assert first.add("barrier", 0) == 100 and int(second.get("barrier")) == 100
    assert first.compare_set("flag", b"", b"up") == b"up" and second.compare_set("flag", b"down", b"x") == b"up"
    first.append("log", b"a")
    second.append("log", b"b")
    assert first.get("log") == b"ab"
    stranger = _stranger(port)
    for key in stranger.list_keys():
        stranger.set(key, b"999")
    with pytest.raises(StoreTamperedError, match="'barrier'"):
        first.add("barrier", 1)
    assert host.num_keys() > 0
