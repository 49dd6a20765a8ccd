"""A rollout engine that dies during a weight round: what each end of the round does, without vLLM.

Where a round's data travels (``rollout.vllm_mode=server_process``, ``vllm_server``). The rollout rank does not
forward the weights to its engine: it only tells the engine, bucket by bucket, what comes next (names, dtypes and
shapes, over vLLM's control plane: ``update_weights``), and the engine's workers take the tensors straight from the
sending actor rank, as members of one communicator with it: our gloo group on CPU, vLLM's NCCL communicator on GPU.
So when the engine dies mid-round, what the rollout rank still has to take from the sender is only the buckets'
descriptions (they cross the control plane with the first round alone), and whether the sender can finish its round
depends on what its broadcast does when the workers it broadcasts to are gone:

- ``gloo``: the broadcast fails at once (``Connection closed by peer``) when the workers' processes are gone,
  whether the sender was already waiting in it or enters it later; it never completes into a peer that did not take
  the data (measured on CPU: a root's broadcast returns only once its peer has received it, for 400 bytes as for
  40 MB, and fails within 0.1 s of the peer's SIGKILL). vLLM's workers exit when their engine core does (its death
  pipe). So the sender skips the lost engine for the rest of the round (:class:`LostReceivers`; its other engines
  get theirs), and the rollout rank notices the death (vLLM's engine-dead flag), lets the rest of the round go by
  and leaves the engine dead (:func:`receive_round`). A dead engine generates nothing: it is restarted at its next
  generation or service point (``engine_restart``), and the new one gets the whole current round from its sender
  there before it generates. A partial round never generates.
- ``nccl``: the sender's broadcast is a kernel that waits for its peers. A peer lost in the middle of one is
  expected to leave it waiting without end, and vLLM's communicator (``PyNcclCommunicator``) offers no abort, so
  neither the sender's stream nor its channel could be freed for a new round (a hypothesis: this path has never run
  on a GPU). A death before the round's last bucket was loaded therefore ends the job: :class:`WeightRoundError`,
  raised on the rollout rank as soon as the death is noticed (well under a second), names the engine, the phase and
  the cause, and the launcher ends the other ranks, the waiting sender with them. A death after the last bucket was
  loaded leaves the sender no broadcast to wait in; it is restarted as with gloo.

A failure that is not the engine's death (an error raised by a live engine) still ends the job, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from hpc_rlhf.rollout.engine_restart import EngineFailure

log = logging.getLogger(__name__)

Bucket = TypeVar("Bucket")
# Weight-transfer backends whose sender survives its receivers' death in the middle of a broadcast (module docstring).
SURVIVES_LOST_RECEIVER = frozenset({"gloo"})


class WeightRoundError(RuntimeError):
    """An engine died during a weight round where the round can be neither finished nor sent again, or a sender
    heard that an engine it lost mid-round went on without a restart: the job ends with this error."""


def receive_round(buckets: Iterable[Bucket], *, begin: Callable[[], None], load: Callable[[Bucket], None],
                  finish: Callable[[], None], engine_name: str, backend: str) -> EngineFailure | None:
    """The rollout rank's side of one weight round over an engine that may die part-way.

    ``begin()`` (pause generation, start the update), ``load(bucket)`` for each bucket as ``buckets`` yields it,
    ``finish()`` (finish the update, resume generation); each raises :class:`EngineFailure` when the engine died.
    Any other error propagates as it is.

    Returns None when the round completed. After a death: the rest of ``buckets`` is consumed (on the first round
    that is the sender's descriptions, so that it goes on with its round) and the failure is returned, its cause
    naming the weight round and how far it got; the engine is to be restarted before it generates again.

    Raises:
        WeightRoundError: the engine died before every bucket was loaded, over a ``backend`` whose sender does not
            survive that (``nccl``): raised at once, without waiting for the rest of the round (the sender is stuck
            in its broadcast and will send no more).
    """
    remaining = iter(buckets)
    drawn = loaded = 0  # buckets taken from the sender, and loaded by the engine
    try:
        begin()
        for bucket in remaining:
            drawn += 1
            load(bucket)
            loaded += 1
    except EngineFailure as failure:
        if backend not in SURVIVES_LOST_RECEIVER:
            raise WeightRoundError(
                f"{engine_name} died during a weight round, after {loaded} bucket(s) were loaded: {failure.cause}. "
                f"Its workers share a {backend} communicator with the sending actor rank, which is left waiting in "
                "its broadcast to them: the round can be neither finished nor sent again, so the job ends (a death "
                "between weight rounds, or after a round's last bucket, is restarted: rollout.max_engine_restarts)"
            ) from failure
        total = drawn + sum(1 for _ in remaining)
        return EngineFailure(f"during a weight round ({loaded} of {total} bucket(s) loaded), {failure.cause}",
                             failure.incarnation)
    try:
        finish()
    except EngineFailure as failure:
        return EngineFailure(f"during a weight round (all {loaded} bucket(s) loaded, not finished), {failure.cause}",
                             failure.incarnation)
    return None


class LostReceivers:
    """The engines a sending actor rank lost during a weight round, kept until their rank reports the restart.

    A send that fails (the engine's workers are gone) takes the engine out of the rest of the round, if its channel
    says it survives that (``survives_lost_receiver``: the gloo channel); otherwise the sender stops with a
    :class:`WeightRoundError`. The engine's rank restarts the engine and reports ``restarted`` at the next service
    point, where the sender reopens the channel and sends the whole round (``EngineChannelWeightSync.serve``). Were
    it to report ``done`` instead, its engine would hold a partial round: :meth:`reported_done` stops the job."""

    def __init__(self, rank: int):
        self.rank = rank
        self.causes: dict[int, str] = {}  # engine rank -> where and why its round failed

    def skips(self, engine: int) -> bool:
        """Whether the rest of this round leaves ``engine`` out."""
        return engine in self.causes

    def send_failed(self, engine: int, channel: Any, error: BaseException, bucket: int, num_buckets: int) -> None:
        """Sending bucket ``bucket`` (0-based) of ``num_buckets`` to ``engine`` over ``channel`` raised ``error``."""
        where = f"bucket {bucket + 1} of {num_buckets} of a weight round"
        if not getattr(channel, "survives_lost_receiver", False):
            raise WeightRoundError(
                f"rank {self.rank}: sending {where} to rank {engine}'s rollout engine failed "
                f"({type(error).__name__}: {error}); its channel ({type(channel).__name__}) cannot be given up in the "
                "middle of a broadcast, so the round can be neither finished nor sent again and the job ends"
            ) from error
        self.causes[engine] = f"{where} ({type(error).__name__}: {error})"
        log.warning("rank %d: lost rank %d's rollout engine in %s; the rest of the round leaves it out, and its rank "
                    "restarts it and gets the whole round at the next service point", self.rank, engine,
                    self.causes[engine])

    def restarted(self, engine: int) -> None:
        """``engine``'s rank reports a restarted engine: it gets a whole round now."""
        self.causes.pop(engine, None)

    def reported_done(self, engine: int) -> None:
        """``engine``'s rank reports done at a service point; refused while its last round is partial."""
        if engine in self.causes:
            raise WeightRoundError(
                f"rank {self.rank}: rank {engine} reports its rollout engine done, but the weight round sent to it "
                f"failed at {self.causes.pop(engine)} and it reported no restart: its engine would generate with a "
                "partial round, so the job ends")
