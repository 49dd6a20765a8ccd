"""A job-private view of an unauthenticated ``torch.distributed`` store.

``TCPStore`` lets every client that reaches its port list (``list_keys``), read, write and delete any key. The
rendezvous of the job's world and of its weight channels goes through such stores: gloo's and NCCL's addresses,
NCCL's unique ids, barriers. :class:`SealedStore` wraps the store so that what the job's ranks exchange is
neither readable nor changeable by another client:

- key names are replaced by ``sealed/<HMAC-SHA256(name key, namespace/key)>``: a listing shows no name torch uses,
  and a client without the secret cannot compute the name of any key;
- values are encrypted and authenticated with AES-GCM (``cryptography``) under a key derived from the secret, the
  key's name bound in as associated data: a value another client wrote, changed or moved from another key fails to
  open, and the rank stops with :class:`StoreTamperedError` naming the key and the store, instead of using it.

Counters (``add``) and ``compare_set`` / ``append`` are compare-and-swap loops over sealed values, since the server
cannot add to a value it cannot read. What this does not stop: a client that reaches the port can still delete or
overwrite the job's (sealed) keys and flood the server, which makes the job wait until its timeout or stop with
the error above (denial of service); see docs/reliability.md, "Shared clusters".
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hpc_rlhf.world.job_secret import JobSecretError

SEALED_KEY_PREFIX = "sealed/"
SECRET_CHECK_PREFIX = "hpc_rlhf/secret_check/"
_NONCE_BYTES = 12
_TAG_BYTES = 16


class StoreTamperedError(RuntimeError):
    """A value in the job's store was not written by the job (or was changed since)."""


@dataclass(frozen=True)
class _Keys:
    names: bytes
    values: bytes
    fingerprint: str


def _derive(secret: str, namespace: str) -> _Keys:
    """Separate keys for names, values and the published fingerprint (HMAC-SHA256 as the derivation function)."""
    def label(purpose: str) -> bytes:
        return hmac.new(secret.encode(), f"hpc_rlhf store {purpose} {namespace}".encode(), hashlib.sha256).digest()
    return _Keys(names=label("names"), values=label("values"), fingerprint=label("fingerprint").hex()[:32])


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """``store`` seen through the job's secret (see the module docstring). ``namespace`` separates the stores of
    one job (the world's, each weight channel's): a value copied from one into another does not open.

    Usable wherever torch takes a store: ``init_process_group(store=...)``, ``ProcessGroupGloo(store, ...)``.
    """

    def __init__(self, store: dist.Store, secret: str, namespace: str, where: str = "the rendezvous store"):
        super().__init__()
        # Any: torch's stubs type store values as str, where its stores take and return bytes (and lack clone).
        self._store: Any = store
        self._secret, self._namespace, self._where = secret, namespace, where
        keys = _derive(secret, namespace)
        self._name_key = keys.names
        self._aead = AESGCM(keys.values)

    @property
    def underlying_store(self) -> dist.Store:
        return self._store

    # ------------------------------------------------------------------ sealing
    def _key(self, key: str) -> str:
        return SEALED_KEY_PREFIX + hmac.new(self._name_key, key.encode(), hashlib.sha256).hexdigest()

    def _seal(self, key: str, value: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, value, key.encode())

    def _open(self, key: str, sealed: bytes) -> bytes:
        if len(sealed) >= _NONCE_BYTES + _TAG_BYTES:
            try:
                return self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], key.encode())
            except InvalidTag:
                pass
        raise StoreTamperedError(
            f"the value of key {key!r} in {self._where} was not written by this job, or was changed: another process "
            "that can reach the store's port wrote to it. This rank stops rather than use it; resubmit the job, and "
            "see docs/reliability.md, 'Shared clusters'")

    # ------------------------------------------------------------------ torch's Store interface
    def set(self, key: str, value) -> None:
        self._store.set(self._key(key), self._seal(key, _as_bytes(value)))

    def get(self, key: str) -> bytes:
        return self._open(key, self._store.get(self._key(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get([self._key(key) for key in keys])
        return [self._open(key, value) for key, value in zip(keys, values, strict=True)]

    def multi_set(self, keys: list[str], values: list) -> None:
        self._store.multi_set([self._key(key) for key in keys],
                              [self._seal(key, _as_bytes(value)) for key, value in zip(keys, values, strict=True)])

    def _swap(self, key: str, update) -> bytes:
        """Replace the value of ``key`` (b"" when absent) by ``update(old)`` atomically and return the new value;
        ``update`` returning None changes nothing and the old value is returned."""
        name = self._key(key)
        current = self._store.get(name) if self._store.check([name]) else b""  # sealed; b"": absent
        while True:
            plain = self._open(key, current) if current else b""
            new_plain = update(plain)
            if new_plain is None:
                return plain
            new = self._seal(key, new_plain)
            result = self._store.compare_set(name, current, new)
            if result == new:
                return new_plain
            # torch returns the stored value on a mismatch, and the expected one back when the key is absent.
            current = b"" if result == current else result

    def add(self, key: str, amount: int) -> int:
        return int(self._swap(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value) -> None:
        self._swap(key, lambda old: old + _as_bytes(value))

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        return self._swap(key, lambda old: desired if old == expected else None)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._key(key) for key in keys])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self._key(key) for key in keys]
        if timeout is None:
            self._store.wait(names)
        else:
            self._store.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> SealedStore:
        return SealedStore(self._store.clone(), self._secret, self._namespace, self._where)


def check_job_secret(store: dist.Store, secret: str, namespace: str, *, publisher: bool, where: str) -> None:
    """Stop at once when this rank's secret differs from the publisher's (rank 0's), instead of waiting for keys
    whose sealed names it cannot compute until the timeout. The publisher writes a fingerprint of its secret (an
    HMAC of it: it tells nothing about the secret); every other rank compares.

    Raises:
        JobSecretError: the fingerprints differ.
    """
    key = SECRET_CHECK_PREFIX + namespace
    fingerprint = _derive(secret, namespace).fingerprint
    if publisher:
        store.set(key, fingerprint)
        return
    published = _as_bytes(store.get(key)).decode(errors="replace")
    if not hmac.compare_digest(published, fingerprint):
        raise JobSecretError(
            f"this rank's job secret differs from the one rank 0 published in {where}: the ranks were started with "
            "different HPC_RLHF_JOB_SECRET values, or derived it from different key files (nodes that do not share "
            "the home directory: set HPC_RLHF_JOB_SECRET for the whole job, as the sbatch recipes do), or another "
            "process overwrote the check key. See docs/reliability.md, 'Shared clusters'")


def sealed_tcp_store(host: str, port: int, *, rank: int, world_size: int, secret: str, namespace: str,
                     timeout: datetime.timedelta, listen_fd: int | None = None,
                     is_master: bool | None = None) -> SealedStore:
    """A ``TCPStore`` on ``host:port`` (hosted by rank 0 unless ``is_master`` says otherwise, on ``listen_fd``
    when given), sealed with ``secret`` and the secret check passed. Collective over the ``world_size`` ranks."""
    master = rank == 0 if is_master is None else is_master
    # wait_for_workers=False: its worker count is an unsealed counter that any client may bump; the sealed
    # rendezvous on top waits for the job's own ranks.
    if listen_fd is None:
        store = dist.TCPStore(host, port, world_size, is_master=master, timeout=timeout, wait_for_workers=False)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=master, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listen_fd)
    where = f"the {namespace} store at {host}:{port}"
    check_job_secret(store, secret, namespace, publisher=rank == 0, where=where)
    return SealedStore(store, secret, namespace, where)
