"""vLLM rollout on the two-node cluster: another user's node against the weight channel between the nodes and the
agents' endpoint, and a LoRA adapter staged on the engine's own node.

The first job: the vLLM recipe (configs/grpo_vllm_async_tiny_cpu.yaml) with an OpenAI-API agent, one task per node. The
actor is rank 0 on hpcmn1; rank 1 on hpcmn2 drives a vLLM engine in processes of its own
(``rollout.vllm_mode=server_process``) and serves the agents' endpoint. Every step's weights go from rank 0 to the
engine's worker over the gloo weight channel, whose sealed store rank 0 binds on a port the kernel picks: the channel
crosses the network. The stranger scans every TCP port of both nodes and tries each as an HTTP server and as a
store (stranger_scan.py); this test, as root, sees which sockets the job's processes own and checks the stranger's
report against them.

The second job: the same recipe with adapter-only LoRA sync; the adapter reaches the engine's rank over the world
and that rank writes it for its engine into its own node's /tmp.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hpc_rlhf.world.launch_env import port_from_job_id
from hpc_rlhf.world.sealed_store import SEALED_KEY_PREFIX, SECRET_CHECK_PREFIX

from ..conftest import FINAL, read_log
from .conftest import (
    ADDRESSES,
    NODES,
    OUTSIDER,
    SHARED_ROOT,
    TWO_NODES,
    WatchedJob,
    in_node,
    job_info,
    rank_pids,
    rows,
    sbatch,
    slurm,
    wait_for_steps,
)

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.usefixtures("multinode_cluster")]
pytest.importorskip("vllm")
pytest.importorskip("openai")

VLLM_JOB = ["--export=ALL,CONFIG=configs/grpo_vllm_async_tiny_cpu.yaml", "slurm/cpu_debug.sbatch"]
# the endpoint over TCP (its default is a Unix socket in a private folder, which no other node can address at all):
# the listener another node could try to reach
AGENT = ["train.agent_func_path=examples/agents/openai_math_agent.py", "data.max_len=64", "rollout.agent_endpoint=tcp"]
CHANNEL_CHECK_PREFIX = SECRET_CHECK_PREFIX + "weight_transfer/"  # the channel's store namespace (vllm_gloo_transfer)
ENDPOINT_REFUSAL = "unknown episode"  # openai_guard's 401 to a key that is no episode id
LISTEN, ESTABLISHED = "0A", "01"  # /proc/net/tcp socket states


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp (IPv4) or tcp6 (IPv6, 32-bit words in host order); IPv4-mapped as IPv4."""
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    address = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return address.removeprefix("::ffff:") if "." in address else address


def _tcp_table(pid: int) -> list[tuple[str, int, str, int, str, int]]:
    """The TCP sockets (IPv4 and IPv6) of the network namespace ``pid`` is in: (local address, port, remote address,
    port, state, inode). A TCPStore listens on IPv6's any address, which takes IPv4 too."""
    table = []
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            (local, local_port), (remote, remote_port) = (f.split(":") for f in fields[1:3])
            table.append((_address(local), int(local_port, 16), _address(remote), int(remote_port, 16), fields[3],
                          int(fields[9])))
    return table


def _listening(pid: int) -> dict[int, str]:
    """``{port: address}`` of the TCP sockets process ``pid`` itself listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return {port: addr for addr, port, _, _, state, inode in _tcp_table(pid) if state == LISTEN and inode in inodes}


def _listeners_of_node(pid: int) -> dict[int, str]:
    """``{port: "program (pid)"}`` of every process listening in the network namespace ``pid`` is in (for the
    report: which of the job's processes the stranger's scan found)."""
    netns = Path(f"/proc/{pid}/ns/net").readlink()
    owners = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "ns/net").readlink() != netns:
                continue
            name = (proc / "comm").read_text().strip()
            for port in _listening(int(proc.name)):
                owners[port] = f"{name} ({proc.name})"
        except OSError:
            continue
    return owners


def _slurm_rank(pid: int) -> int:
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text(errors="replace")
                   .split("\0") if "=" in item)
    return int(environ["SLURM_PROCID"])


def _status_on_node(node: str, url: str) -> tuple[int | None, str]:
    """GET ``url`` without a key from inside ``node`` (a user logged in there)."""
    code = ("import httpx, json, sys\ntry:\n    r = httpx.get(sys.argv[1], timeout=5)\n"
            "    print(json.dumps([r.status_code, r.text[:200]]))\nexcept httpx.HTTPError as e:\n"
            "    print(json.dumps([None, type(e).__name__]))\n")
    out = in_node(node, sys.executable, "-c", code, url, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    status, body = json.loads(out.stdout.strip().splitlines()[-1])
    return status, body


def test_another_users_node_cannot_use_the_weight_channel_or_the_agent_endpoint(shared_dir):
    log, run = shared_dir / "job.out", shared_dir / "run"
    job = sbatch("-o", str(log), *TWO_NODES, *VLLM_JOB, *AGENT, "train.max_steps=100", "ckpt.save_steps=1000",
                 f"train.output_dir={run}")
    metrics = run / "metrics.jsonl"
    try:
        # two steps: the channel opened at the first weight sync, the endpoint served the first episodes
        wait_for_steps(job, metrics, log, at_least=2, restarts=0, timeout_s=400)
        pids = {_slurm_rank(pid): pid for pid in rank_pids(run)}
        assert sorted(pids) == [0, 1], pids
        sender_ports, engine_rank_ports = _listening(pids[0]), _listening(pids[1])
        endpoints = [port for port, addr in engine_rank_ports.items() if addr == "127.0.0.1"
                     and ENDPOINT_REFUSAL in _status_on_node(NODES[1], f"http://127.0.0.1:{port}/v1/models")[1]]
        assert len(endpoints) == 1, (engine_rank_ports, endpoints)
        endpoint = endpoints[0]
        # the engine's side of the channel: a connection from hpcmn2 to a store port of rank 0 on hpcmn1
        to_sender = {port for _, _, addr, port, state, _ in _tcp_table(pids[1])
                     if state == ESTABLISHED and addr == ADDRESSES[NODES[0]] and port in sender_ports}

        go = shared_dir / "go"
        go.write_text("go\n")
        stranger = subprocess.run(["ip", "netns", "exec", OUTSIDER, sys.executable,
                                   str(Path(__file__).parent / "stranger_scan.py"), str(go),
                                   ADDRESSES[NODES[0]], ADDRESSES[NODES[1]]],
                                  capture_output=True, text=True, timeout=300)
        assert stranger.returncode == 0, stranger.stderr[-3000:]
        seen = json.loads(stranger.stdout.strip().splitlines()[-1])
        steps_then = len(rows(metrics))
        owners = {node: _listeners_of_node(pids[rank]) for rank, node in enumerate(NODES)}
        # Whether the job goes on after the scan is reported, not asserted: the scan writes HTTP requests and store
        # handshakes into every open port, gloo's pair listeners included, which authenticate nothing; on the
        # merged code the job once ended after the scan with rank 0's gloo connection closed (docs/slurm.md).
        try:
            wait_for_steps(job, metrics, log, at_least=steps_then + 1, restarts=0)  # one more step: it goes on
            alive_at_end = _status_on_node(NODES[1], f"http://127.0.0.1:{endpoint}/v1/models")
        except AssertionError as ended:
            alive_at_end = (None, f"the job ended after the scan: {str(ended)[-600:]}")
    finally:
        if job_info(job).get("JobState") not in FINAL:
            slurm("scancel", job, check=False)
    ranks = json.loads((run / "world.json").read_text())["ranks"]
    assert [r["host"] for r in ranks] == list(NODES), ranks

    sender_host, engine_host = (seen["hosts"][ADDRESSES[node]] for node in NODES)
    # (a) the weight channel: its store is found on rank 0's node, on a port of its own that rank 0 listens on
    channels = {int(port): store for port, store in sender_host["stores"].items()
                if any(key.startswith(CHANNEL_CHECK_PREFIX) for key in store["keys"])}
    assert len(channels) == 1, sender_host["stores"]
    (channel_port, channel), = channels.items()
    assert channel_port in sender_ports and channel_port != port_from_job_id(job), (channel_port, sender_ports)
    assert channel_port in to_sender, (channel_port, to_sender)  # the engine on hpcmn2 is connected to it
    assert [k for k in channel["keys"] if not k.startswith((SEALED_KEY_PREFIX, SECRET_CHECK_PREFIX))] == [], channel
    assert not channel["plain_text_seen"], "the channel's store showed names, addresses or dtypes in plain text"
    assert channel["joins"] and "joined" not in channel["joins"].values(), channel["joins"]
    # the world's own store too (the rendezvous test of test_multinode_jobs shows more of it)
    assert str(port_from_job_id(job)) in sender_host["stores"], sender_host["stores"].keys()
    # (b) the agents' endpoint: served on hpcmn2's loopback only; no port of either node answers as it
    print(f"after the scan: {alive_at_end}")
    assert endpoint not in engine_host["open"] and endpoint not in sender_host["open"], endpoint
    answers = {f"{addr}:{port}": answer for addr, host in seen["hosts"].items()
               for port, probes in host["http"].items() for answer in probes.values() if answer}
    assert not [where for where, answer in answers.items()
                if "API key" in answer or "chat.completion" in answer or '"object"' in answer], answers
    for node, host in zip(NODES, (sender_host, engine_host), strict=True):
        print(f"{node}: " + ", ".join(f"{port} {owners[node].get(port, '?')}" for port in host["open"]))
    print(f"stranger on {OUTSIDER}: open ports {NODES[0]} {sender_host['open']}, {NODES[1]} {engine_host['open']}; "
          f"weight channel store :{channel_port} ({len(channel['keys'])} sealed keys, joins refused); endpoint "
          f"127.0.0.1:{endpoint} on {NODES[1]} not reachable; {len(rows(metrics))} steps, then cancelled; the scan "
          f"took {seen['finished'] - seen['started']:.1f}s")


ADAPTER_FOLDERS = "ls -d /tmp/hpc-rlhf-lora-*/adapter_model.safetensors 2>/dev/null || true"


def _list_adapter_folders(job: WatchedJob) -> None:
    job.seen.update({node: in_node(node, "sh", "-c", ADAPTER_FOLDERS).stdout.split() for node in NODES})


@pytest.fixture(scope="module", autouse=True)
def lora_job(multinode_cluster):
    """The LoRA job, submitted before the module's first test so that it runs beside the first test's job (its
    vLLM start-up fills the other job's waits); each node's adapter folders are listed once it has logged a step (the
    folders go when the engine closes)."""
    folder = SHARED_ROOT / f"lora-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    log, run = folder / "lora.out", folder / "lora"
    job = WatchedJob(sbatch("-o", str(log), *TWO_NODES, *VLLM_JOB, "ds.lora.rank=8", "ds.lora.alpha=16",
                            "ds.lora.sync=adapter", "train.async_train=false", "train.max_steps=4",
                            f"train.output_dir={run}"),
                     log, timeout_s=900, metrics=run / "metrics.jsonl", while_running=_list_adapter_folders)
    yield job, run
    job.cancel()
    shutil.rmtree(folder, ignore_errors=True)


def test_a_lora_adapter_is_staged_on_the_engines_node_only(lora_job):
    """``ds.lora.sync=adapter`` (on-policy): rank 1 on hpcmn2 writes each synced adapter for its engine into a folder
    of its node's /tmp (no ``$SLURM_TMPDIR`` here). The folder exists on hpcmn2 only, the engine samples with the
    adapter it loads from there (its logprobs equal the trainer's), and the folder goes when the job ends."""
    from tests.multiproc.test_lora_adapter_sync import assert_engine_matches_trainer

    job, run = lora_job
    info = job.result()
    staged = job.seen
    assert info["JobState"] == "COMPLETED", read_log(job.log)[-3000:]
    assert len(staged[NODES[1]]) == 1 and staged[NODES[0]] == [], staged
    assert not Path(staged[NODES[1]][0]).parent.exists()  # nor in this (login) node's /tmp
    assert in_node(NODES[1], "sh", "-c", ADAPTER_FOLDERS).stdout.split() == []  # removed with the engine
    logged = rows(run / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert_engine_matches_trainer(logged)
    print(f"LoRA adapter staged at {staged[NODES[1]][0]} on {NODES[1]} only")
