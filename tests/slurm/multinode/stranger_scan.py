"""Another user's process on another node (run in namespace hpcmnx) against everything a running job listens on:
``stranger_scan.py GO_FILE ADDRESS...``. It waits for GO_FILE, then finds every open TCP port of each address by a
connect scan (as anyone on the network can) and tries each one as the job's services would answer:

- as an HTTP server (the agents' OpenAI-compatible endpoint): ``GET /v1/models`` and a chat completion with a
  made-up key; what answered is reported;
- as a ``TCPStore`` (the world's rendezvous, a weight channel's store): list and read every key, write where an
  unsealed store's keys would be, and join a gloo group on it as rank 1, raw and under the channel's own namespace
  (its name is in the store's plain secret-check key).

Prints what it saw as JSON. Nothing it sends is more than a client of those protocols may send."""

import datetime
import errno
import json
import multiprocessing
import os
import select
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

go, addresses = Path(sys.argv[1]), sys.argv[2:]
os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # a join attempt from this node's own address, not a failed device
CHECK_PREFIX = "hpc_rlhf/secret_check/"
PLAIN_MARKERS = (b"10.77.0.", b"hpcmn", b"weight_transfer", b"model.", b"float32")
BATCH = 4000
STORE_PROBE_S = 20  # a port's whole store probe: connecting, reading, two joins of 4 s, the writes


def open_ports(address: str) -> list[int]:
    """Every TCP port of ``address`` that accepts a connection (non-blocking connects, a batch at a time)."""
    found = []
    for first in range(1, 65536, BATCH):
        pending = {}
        for port in range(first, min(first + BATCH, 65536)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            if sock.connect_ex((address, port)) in (0, errno.EINPROGRESS):
                pending[sock.fileno()] = (sock, port)
            else:
                sock.close()
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLOUT)
        deadline = time.monotonic() + 3
        while pending and time.monotonic() < deadline:
            for fd, _ in poller.poll(200):
                sock, port = pending.pop(fd)
                poller.unregister(fd)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    found.append(port)
                sock.close()
        for sock, _ in pending.values():
            sock.close()
    return sorted(found)


def http_probe(address: str, port: int) -> dict:
    """What a plain HTTP client gets from the port (the first 300 bytes of each answer, or None)."""
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "1+1"}]}).encode()
    requests = {
        "models": b"GET /v1/models HTTP/1.0\r\nHost: x\r\n\r\n",
        "chat": b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer 0\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    }
    seen = {}
    for name, request in requests.items():
        try:
            with socket.create_connection((address, port), timeout=2) as sock:
                sock.sendall(request)
                seen[name] = sock.recv(300).decode(errors="replace") or None
        except OSError as err:
            seen[name] = None if isinstance(err, TimeoutError) else f"{type(err).__name__}"
    return seen


def store_probe(address: str, port: int) -> dict | None:
    """The port as a TCPStore: None when it is none (no answer within the timeout)."""
    try:
        store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=4))
        keys = store.list_keys()
    except Exception:  # noqa: BLE001 - not a store (or not answering): nothing to report
        return None
    values = [store.get(key) for key in keys]
    seen: dict = {"keys": keys, "plain_text_seen": any(m in v for m in PLAIN_MARKERS for v in values)}
    namespaces = [key[len(CHECK_PREFIX):] for key in keys if key.startswith(CHECK_PREFIX)]
    seen["joins"] = {}
    for namespace in [None, *namespaces]:
        target = store if namespace is None else dist.PrefixStore(namespace, store)
        try:
            dist.ProcessGroupGloo(target, 1, 2, datetime.timedelta(seconds=4))
            seen["joins"][str(namespace)] = "joined"
        except Exception as err:  # noqa: BLE001 - any refusal counts; its text goes into the report
            seen["joins"][str(namespace)] = f"{type(err).__name__}: {str(err)[:200]}"
    for rank in range(4):  # then blind writes where an unsealed gloo group's rendezvous keys would be
        store.set(str(rank), b"forged")
        store.set(f"rank_{rank}", b"forged")
    return seen


def store_probes(targets: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """:func:`store_probe` of every ``(address, port)``, each in a child process of its own, all at once (every
    node's ports together): a port that accepts and never answers (gloo's listeners) holds a TCPStore client past its
    own timeout, so a child that is not done in STORE_PROBE_S is killed (and its port is no store)."""
    context = multiprocessing.get_context("fork")
    children = []
    for target in targets:
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=lambda t=target, out=sender: out.send(store_probe(*t)), daemon=True)
        child.start()
        children.append((target, child, receiver))
    deadline = time.monotonic() + STORE_PROBE_S
    found = {}
    for target, child, receiver in children:
        try:
            seen = receiver.recv() if receiver.poll(max(deadline - time.monotonic(), 0)) else None
        except (EOFError, OSError):  # the probe died without an answer (gloo aborts the process on some peers)
            seen = None
        if seen is not None:
            found[target] = seen
        child.kill()
        child.join()
    return found


deadline = time.monotonic() + 600
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
report: dict = {"started": time.time(), "hosts": {}}
open_by_host = {address: open_ports(address) for address in addresses}
targets = [(address, port) for address, ports in open_by_host.items() for port in ports]
with ThreadPoolExecutor(max_workers=16) as pool:
    http = dict(zip(targets, pool.map(lambda target: http_probe(*target), targets), strict=True))
# after the threads are gone: each probe forks. Every node's at once: each node's gloo listeners hold their probes
# the whole STORE_PROBE_S, which the nodes then spend together, not one after the other.
stores = store_probes(targets)
for address, ports in open_by_host.items():
    report["hosts"][address] = {"open": ports, "http": {str(p): http[address, p] for p in ports},
                                "stores": {str(p): stores[address, p] for p in ports if (address, p) in stores}}
report["finished"] = time.time()
print(json.dumps(report), flush=True)
