"""Another user's process on another node of the same network (run in namespace hpcmnx) against a running job's
rendezvous store: ``stranger.py HOST PORT GO_FILE``. It imports torch, waits for GO_FILE (the test writes it once
the job is past its first step), then connects as any user can, lists and reads the store, writes where torch's
own keys would be, and tries to join the job's world as rank 1. Prints what it saw as JSON."""

import datetime
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

host, port, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
deadline = time.monotonic() + 300
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
seen: dict = {"started": time.time()}
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
keys = store.list_keys()
values = [store.get(key) for key in keys]
seen["keys"] = keys
# the nodes' addresses and names are in the store (each node's leader publishes its address): sealed, not readable
seen["plain_text_seen"] = any(b"10.77.0." in value or b"hpcmn" in value for value in values)
for group in range(4):  # blind writes where torch's rendezvous keys would be on an unsealed store
    for rank in range(2):
        store.set(f"default_pg/{group}//cpu//0/{rank}", b"forged")
try:
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=4))
    seen["joined"] = True
except Exception as err:  # noqa: BLE001 - any refusal counts; its text goes into the report
    seen["joined"] = False
    seen["join_error"] = f"{type(err).__name__}: {str(err)[:300]}"
seen["finished"] = time.time()
print(json.dumps(seen), flush=True)
