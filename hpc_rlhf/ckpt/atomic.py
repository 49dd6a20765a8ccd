"""Crash-safe checkpoint directories: temp dir -> COMPLETE marker -> rename -> LATEST pointer -> rotation.

Layout under ``root``::

    root/step_<N>/            a complete checkpoint (always holds COMPLETE, a JSON manifest)
    root/LATEST               text "step_<N>", replaced atomically; the commit point
    root/.tmp_*               in-flight or crashed saves; ignored by loading, removed by the next save

Guarantees (single writer per ``root``; every rank sees the same filesystem, e.g. Lustre/GPFS/NFS):

- A ``step_<N>`` directory only ever appears with its COMPLETE marker inside: rank 0 writes COMPLETE into
  the temp dir and then renames the whole directory, so loading never sees a half-written checkpoint.
- LATEST moves only after the rename is durable (directory fsync), and rotation runs only after LATEST
  moved, and never deletes LATEST's target. A crash at any point leaves the previous LATEST checkpoint
  intact and loadable.
- A crash between the rename and the LATEST update leaves a complete ``step_<N>`` that LATEST does not
  point to: :meth:`CheckpointManager.latest` keeps returning the checkpoint LATEST names (LATEST is the
  commit point); the orphan is an ordinary complete checkpoint for rotation, and saving the same step
  again replaces it.

Resume (:meth:`CheckpointManager.latest_verified`) loads the newest checkpoint whose files match its manifest
(sizes and BLAKE2b digests). A LATEST that is garbage, names a missing or incomplete directory, or names a
damaged checkpoint makes it fall back to the newest one that verifies, with a warning naming each bad file; it
raises, naming them, rather than start fresh when checkpoints (or their traces: LATEST, ``step_<N>`` folders)
exist but none is loadable.

Failure contract across ranks: only rank 0 commits, and only after every rank passed the barrier that
follows the body of :meth:`CheckpointManager.saving`. A rank that raises inside the body skips that
barrier, so the other ranks' barrier fails by the caller's collective timeout (the world's
``init_process_group(timeout=...)``, or a dedicated group passed as ``barrier``) or by the launcher
killing the job (``srun --kill-on-bad-exit``); either way nothing is committed. Pass a barrier with a
short timeout if you want a save failure to surface faster than the world's default timeout.

This module imports no torch: the default barrier uses ``torch.distributed`` only if torch is already
imported and the default process group is initialised.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# A save that fails while the filesystem has less free space than this is reported as out of space.
LOW_SPACE_BYTES = 64 << 20


class CheckpointSpaceError(OSError):
    """A checkpoint save failed because its filesystem is full (or a quota is exhausted)."""


LATEST_NAME = "LATEST"
COMPLETE_NAME = "COMPLETE"
TMP_PREFIX = ".tmp_"
_STEP_RE = re.compile(r"^step_(\d+)$")


# ----------------------------------------------------------------------------- durable small writes

def fsync_dir(path: str | Path) -> None:
    """Make a rename/create/unlink inside ``path`` durable. Some filesystems refuse directory fsync."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:  # pragma: no cover - platform specific
        log.debug("cannot open %s for fsync: %s", path, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # pragma: no cover - e.g. EINVAL on some network filesystems
        log.debug("directory fsync of %s failed: %s", path, exc)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old content or the new one, never a mix.

    Temp file in the same directory (so ``os.replace`` is a rename within one filesystem), fsync, replace,
    fsync the directory.
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def save_json_atomic(path: str | Path, obj: Any) -> None:
    """Serialise ``obj`` as JSON and write it atomically (for controller / resume state)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def load_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ----------------------------------------------------------------------------- barrier / rank defaults

def _initialised_dist():
    """``torch.distributed`` if torch is already imported and the default group is up, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def _default_barrier() -> None:
    dist = _initialised_dist()
    if dist is not None:
        dist.barrier()


def _default_rank() -> int:
    dist = _initialised_dist()
    return dist.get_rank() if dist is not None else 0


def _default_world_size() -> int:
    dist = _initialised_dist()
    return dist.get_world_size() if dist is not None else 1


def parse_step_name(name: str) -> int | None:
    """``"step_12"`` -> 12; anything else -> None."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def is_complete(step_dir: str | Path) -> bool:
    return (Path(step_dir) / COMPLETE_NAME).is_file()


def read_manifest(step_dir: str | Path) -> dict:
    """The COMPLETE manifest: ``{"step", "time", "time_iso", "world_size", "files": [{"path", "size", "digest"}]}``
    (``digest``: see :func:`file_digest`; manifests written before it existed have sizes only)."""
    return load_json(Path(step_dir) / COMPLETE_NAME)


# Files up to this size are hashed whole (controller state, RNG, small shards); larger ones (model and optimizer
# shards, often GBs) by DIGEST_WINDOW bytes at their start, middle and end, so saving and resuming a large
# checkpoint reads a few MiB per file, not all of it. Truncation is caught by the size check either way.
DIGEST_FULL_LIMIT = 64 << 20
DIGEST_WINDOW = 4 << 20


def file_digest(path: str | Path) -> str:
    """A cheap content hash of ``path`` (BLAKE2b): whole files up to DIGEST_FULL_LIMIT, sampled windows above."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= DIGEST_FULL_LIMIT:
            while chunk := f.read(DIGEST_WINDOW):  # hashlib.file_digest is Python 3.11+
                h.update(chunk)
            return f"blake2b:{h.hexdigest()}"
        for offset in (0, (size - DIGEST_WINDOW) // 2, size - DIGEST_WINDOW):
            f.seek(offset)
            h.update(f.read(DIGEST_WINDOW))
    return f"blake2b-sampled:{h.hexdigest()}"


def verify_checkpoint(step_dir: str | Path) -> list[str]:
    """Problems found comparing the directory with its manifest (missing files, size or content changes);
    [] if none. Each problem names the file at fault."""
    step_dir = Path(step_dir)
    try:
        manifest = read_manifest(step_dir)
    except (OSError, ValueError) as exc:
        return [f"unreadable {COMPLETE_NAME} in {step_dir}: {exc}"]
    problems = []
    for entry in manifest.get("files", []):
        file = step_dir / entry["path"]
        try:
            if not file.is_file():
                problems.append(f"missing {file}")
            elif file.stat().st_size != entry["size"]:
                problems.append(f"size of {file} is {file.stat().st_size}, manifest says {entry['size']}")
            elif "digest" in entry and file_digest(file) != entry["digest"]:
                problems.append(f"content of {file} changed since it was saved (hash differs from the manifest)")
        except OSError as exc:
            problems.append(f"cannot read {file}: {exc}")
    return problems


# ----------------------------------------------------------------------------- the manager

class CheckpointManager:
    """Owns ``root``: atomic commit of step directories, the LATEST pointer and rotation.

    Args:
        root: checkpoint root, on a filesystem every rank sees (shared FS assumed; checked on entry).
        max_num: complete checkpoints kept after a save (LATEST's target always among them); None keeps all.
        rank: this process's rank among the ranks that call :meth:`saving` together (default: the
            torch.distributed rank, or 0). Rank 0 does all the directory work.
        barrier: a callable every saving rank calls at the same points (default:
            ``torch.distributed.barrier`` when initialised, else a no-op for single-process use).
        world_size: recorded in the manifest (default: the torch.distributed world size, or 1).
        visibility_timeout_s: how long a non-zero rank waits for rank 0's temp dir to become visible
            (network filesystems may cache directory lookups) before failing with a shared-FS error.
    """

    def __init__(self, root: str | Path, max_num: int | None = 3, rank: int | None = None,
                 barrier: Callable[[], None] | None = None, world_size: int | None = None,
                 visibility_timeout_s: float = 30.0) -> None:
        if max_num is not None and max_num < 1:
            raise ValueError(f"max_num must be >= 1 or None (keep all), got {max_num}")
        self.root = Path(root)
        self.max_num = max_num
        self.rank = _default_rank() if rank is None else rank
        self.world_size = _default_world_size() if world_size is None else world_size
        self._barrier = barrier or _default_barrier
        self.visibility_timeout_s = visibility_timeout_s

    # ---------------------------------------------------------------- paths and queries
    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def tmp_dir(self, step: int) -> Path:
        return self.root / f"{TMP_PREFIX}step_{step}"

    @property
    def latest_file(self) -> Path:
        return self.root / LATEST_NAME

    def list_complete(self) -> list[tuple[int, Path]]:
        """Complete ``(step, dir)`` pairs, oldest first. Temp and incomplete directories are ignored."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            step = parse_step_name(child.name)
            if step is not None and child.is_dir() and is_complete(child):
                found.append((step, child))
        return sorted(found)

    def _read_latest_pointer(self) -> tuple[Path | None, str | None]:
        """(target, None) when LATEST names a complete dir; (None, reason) otherwise."""
        try:
            text = self.latest_file.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None, "is missing"
        except (OSError, UnicodeDecodeError) as exc:
            return None, f"is unreadable ({exc})"
        if parse_step_name(text) is None:
            return None, f"is corrupt (content {text[:64]!r})"
        target = self.root / text
        if not is_complete(target):
            return None, f"names {text}, which is not a complete checkpoint"
        return target, None

    def latest(self) -> Path | None:
        """The checkpoint to resume from, always a complete one; None when there is none.

        LATEST's target when it names a complete directory; otherwise (LATEST missing, corrupt or naming an
        incomplete directory) the newest complete ``step_<N>``, with a warning.
        """
        target, problem = self._read_latest_pointer()
        if target is not None:
            return target
        complete = self.list_complete()
        if not complete:
            if problem != "is missing":
                log.warning("checkpoint root %s: LATEST %s and no complete checkpoint exists", self.root, problem)
            return None
        _, fallback = complete[-1]
        log.warning("checkpoint root %s: LATEST %s; falling back to the newest complete checkpoint %s",
                    self.root, problem, fallback.name)
        return fallback

    def latest_verified(self) -> Path | None:
        """The checkpoint to resume from: :meth:`latest` if it verifies against its manifest, else the newest
        complete checkpoint that does (a warning names each bad file). None when there is no complete checkpoint.

        Raises RuntimeError, listing the problems, when complete checkpoints exist but none verifies, or when none
        is complete but an earlier run left LATEST or ``step_<N>`` directories (e.g. a LATEST naming a deleted
        directory): starting fresh over them would silently throw the run away.
        """
        first = self.latest()
        if first is None:
            traces = self._traces_of_earlier_saves()
            if traces:
                raise RuntimeError(
                    f"no complete checkpoint under {self.root}, but an earlier run saved there: "
                    + "; ".join(traces) + "\nrestore the checkpoint, point ckpt.path elsewhere, or set "
                    "ckpt.load=false to start fresh over it")
            return None
        candidates = [first, *(d for _, d in reversed(self.list_complete()) if d != first)]
        rejected: list[str] = []
        for candidate in candidates:
            problems = verify_checkpoint(candidate)
            if not problems:
                if rejected:
                    log.warning("checkpoint root %s: resuming from %s, the newest checkpoint that verifies",
                                self.root, candidate.name)
                return candidate
            log.warning("checkpoint %s is damaged and will not be loaded: %s", candidate, "; ".join(problems))
            rejected.append(f"{candidate.name}: {'; '.join(problems)}")
        raise RuntimeError(f"no checkpoint under {self.root} verifies against its manifest:\n  "
                           + "\n  ".join(rejected)
                           + "\nrestore the damaged files, remove those checkpoints, or set ckpt.load=false to start "
                             "fresh")

    def _traces_of_earlier_saves(self) -> list[str]:
        """What shows that a checkpoint was committed here once (LATEST, ``step_<N>`` directories), each naming
        the file or directory; [] for a root no save ever committed to (interrupted ``.tmp_*`` saves only)."""
        traces = []
        if self.latest_file.exists():
            _, problem = self._read_latest_pointer()
            traces.append(f"{self.latest_file} {problem}")
        for child in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if parse_step_name(child.name) is not None:
                traces.append(f"{child} has no {COMPLETE_NAME} marker")
        return traces

    def latest_step(self) -> int | None:
        latest = self.latest()
        return None if latest is None else parse_step_name(latest.name)

    # ---------------------------------------------------------------- saving
    @contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """Yield the temp dir every rank writes its part of checkpoint ``step`` into; commit on normal exit.

        Every rank must enter and leave this block together (it calls the barrier on entry, after the body
        and after the commit). On an exception in the body nothing is committed (the temp dir stays until
        the next save cleans it) and the exception propagates; see the module docstring for what the other
        ranks see.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        tmp = self.tmp_dir(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            clean_temp_dirs(self.root)
            tmp.mkdir()
            fsync_dir(self.root)
        self._barrier()
        if self.rank != 0:
            self._wait_visible(tmp)
        try:
            yield tmp
        except BaseException as exc:
            log.warning("rank %d: save of step %d failed; not committing (%s left for cleanup)", self.rank, step,
                        tmp)
            self._raise_if_out_of_space(exc, step)
            raise
        self._barrier()  # every rank finished writing
        if self.rank == 0:
            try:
                self._commit(step, tmp)
            except OSError as exc:
                self._raise_if_out_of_space(exc, step)
                raise
        self._barrier()  # nobody reads LATEST before it moved

    def _raise_if_out_of_space(self, exc: BaseException, step: int) -> None:
        """Re-raise a save failure caused by a full filesystem (or quota) as CheckpointSpaceError naming the root.

        torch.save reports a full disk as a bare C++ stream error ("basic_ios::clear: iostream error", "unexpected
        pos"), so besides ENOSPC / EDQUOT anywhere in the exception chain, a failure while the filesystem has
        almost no space left counts too."""
        if not isinstance(exc, Exception):
            return
        chain: BaseException | None = exc
        seen: set[int] = set()
        errno_hit = None
        while chain is not None and id(chain) not in seen:
            seen.add(id(chain))
            if isinstance(chain, OSError) and chain.errno in (errno.ENOSPC, errno.EDQUOT):
                errno_hit = chain.errno
                break
            chain = chain.__cause__ or chain.__context__
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = None
        if errno_hit is None and (free is None or free >= LOW_SPACE_BYTES):
            return
        what = "disk quota exceeded" if errno_hit == errno.EDQUOT else "no space left"
        previous = self.latest()
        kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
        free_text = f", {free / 2**20:.1f} MiB free" if free is not None else ""
        raise CheckpointSpaceError(
            errno_hit or errno.ENOSPC,
            f"{what} on {self.root}{free_text}: the save of step {step} failed ({type(exc).__name__}: {exc}); "
            f"nothing was committed and {kept}. Free space there or point ckpt.path at a filesystem with room "
            "(ckpt.max_num bounds how many checkpoints are kept)") from exc

    def _wait_visible(self, tmp: Path) -> None:
        deadline = time.monotonic() + self.visibility_timeout_s
        while not tmp.is_dir():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {self.rank}: checkpoint temp dir {tmp} created by rank 0 is not visible here after "
                    f"{self.visibility_timeout_s}s; the checkpoint root must be on a filesystem shared by all ranks")
            # a directory listing refreshes cached lookups on network filesystems
            with contextlib.suppress(OSError):
                os.listdir(self.root)
            time.sleep(0.05)

    def _commit(self, step: int, tmp: Path) -> None:
        files = []
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            # Durable data before the marker; on a shared FS each writer's close() already flushed to the servers.
            _fsync_file(path)
            files.append({"path": path.relative_to(tmp).as_posix(), "size": path.stat().st_size,
                          "digest": file_digest(path)})
        for directory in sorted({p.parent for p in tmp.rglob("*")} | {tmp}):
            fsync_dir(directory)
        now = time.time()
        manifest = {"step": step, "time": now, "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
                    "world_size": self.world_size, "files": files}
        save_json_atomic(tmp / COMPLETE_NAME, manifest)

        final = self.step_dir(step)
        if final.exists():
            # An earlier run's crashed (incomplete) copy, or a complete one being re-saved after a resume.
            log.warning("replacing existing %s (%s)", final, "complete" if is_complete(final) else "incomplete")
            discard_dir(self.root, final, "replaced")
        os.rename(tmp, final)
        fsync_dir(self.root)

        atomic_write_text(self.latest_file, final.name + "\n")
        log.info("checkpoint %s committed (%d files)", final, len(files))
        self._rotate(keep=final)

    def _rotate(self, keep: Path) -> None:
        if self.max_num is None:
            return
        others = [d for _, d in reversed(self.list_complete()) if d != keep]
        for stale in others[self.max_num - 1:]:
            # A crash mid-delete leaves a .tmp_ dir, never a step_<N> with some files gone.
            try:
                discard_dir(self.root, stale, "delete")
            except OSError as exc:
                log.warning("could not rotate out %s: %s", stale, exc)
                continue
            log.info("rotated out %s", stale)
        fsync_dir(self.root)


def discard_dir(root: Path, path: Path, reason: str) -> None:
    """Delete ``path``, a child of ``root``, so no reader ever sees it half-deleted: rename it to a ``.tmp_``
    name first (ignored by every listing, cleaned on the next save), make the rename durable, then delete.
    Raises ``OSError`` when the rename fails (``path`` is then untouched)."""
    aside = root / f"{TMP_PREFIX}{reason}_{path.name}_{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    fsync_dir(root)
    _remove(aside)


def clean_temp_dirs(root: Path) -> None:
    """Remove what interrupted saves left under ``root`` (``.tmp_*`` entries)."""
    for child in root.iterdir():
        if child.name.startswith(TMP_PREFIX):
            log.warning("removing leftover %s from an interrupted save", child)
            _remove(child)


def _fsync_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        log.debug("cannot open %s for fsync: %s", path, exc)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
