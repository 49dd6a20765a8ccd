"""Rollout on vLLM in processes of its own (``rollout.vllm_mode=server_process``): GPU nodes, and CPU machines.

Used where the rollout ranks are a subset of the world (disaggregated, partial, asynchronous layouts),
which vLLM's external launcher cannot serve: it takes the whole torch.distributed world as its own.
Here a rollout rank starts vLLM's asynchronous engine (``AsyncLLMEngine``: an engine-core process plus
``tensor_parallel_size`` worker processes on ``devices``, vLLM's own internal world on a port of its own;
built from a config, one worker on the rank's GPU, or on the host's cores on a CPU machine, see
:meth:`VllmServerEngine.from_spec`). Our world stays the control plane: prompts come in and trajectories go
out over it as in every layout; no other rank of the world joins vLLM's groups. vLLM's processes start with our
launch variables removed (:func:`server_process_env`) and are spawned, so a script that builds this engine at its
top level needs the ``if __name__ == "__main__":`` guard (the CLIs have it; spawned children import the main
module again).

Weights travel over a dedicated communicator per engine, with vLLM's RLHF weight-transfer API: one sending actor
rank at rank 0 of that communicator, the engine's workers at ranks ``1 .. tp``, meeting through a rendezvous the
sender makes (NCCL: a unique id it mints; gloo: a sealed store it binds) and the engine's rank passes to vLLM, so
the main world's groups are untouched and each engine's sender can be a different actor rank, all sending in
parallel. One round: ``start_weight_update`` -> ``update_weights`` per bucket (names,
dtypes, shapes: the tensors themselves come over the communicator) -> ``finish_weight_update``. The trainer opens
both ends at its first weight sync and picks each engine's sender
(``hpc_rlhf.weight_sync.sharded.EngineChannelWeightSync``). The backend follows the hardware
(``vllm_transfer_info.transfer_backend``, the same rule on both ends):

- ``gloo`` without CUDA: our backend (:mod:`hpc_rlhf.weight_sync.vllm_gloo_transfer`, registered in vLLM's processes
  by :mod:`hpc_rlhf.rollout.vllm_plugin`); buckets packed one flat buffer per dtype. Runs on CPU and is tested
  there against a real vLLM (``tests/multiproc/test_vllm_server_cpu.py``).
- ``nccl`` on CUDA: vLLM's own (``WeightTransferConfig(backend="nccl")``), joined by a unique id that travels
  through vLLM's control plane (``nccl_unique_id_b64``), never through vLLM's TCP-store rendezvous (its workers
  unpickle what that store holds: ``vllm_transfer_info.worker_init_info`` refuses it), the sender
  (:mod:`hpc_rlhf.weight_sync.vllm_nccl_transfer`) packing with vLLM's ``packed_nccl_broadcast_producer``.
  This path has never run on a GPU: only against fakes (``tests/unit/test_vllm_server.py``,
  ``tests/security/test_weight_channel.py``) and vLLM's API contract (:mod:`hpc_rlhf.rollout.vllm_contract`);
  run it on a GPU node before relying on it.

Weight updates during generation (async and partial rollouts): generation runs on a private asyncio
loop in a background thread, so :meth:`submit` returns at once and a weight round can run while
requests are in flight. The round pauses the engine with ``pause_generation(mode="keep",
clear_cache=True)``: running requests are frozen, not aborted; the KV and prefix caches are dropped, so
on ``resume_generation`` each request recomputes its prompt and the tokens it already produced under
the new weights and continues. Tokens sampled before the pause keep the logprobs of the policy that
sampled them (what importance-sampling corrections need). We chose pause-and-keep over
abort-and-resubmit because it keeps every finished token and needs no bookkeeping of partial outputs.

A dead engine is restarted, not the job: tokens stream back as they are sampled (``RequestOutputKind.DELTA``);
when vLLM's engine-core process exits (``EngineDeadError``) or no token comes back for ``timeout_s``
(``rollout.engine_timeout_s``), the engine's restart supervisor
(:class:`hpc_rlhf.rollout.engine_supervision.RestartSupervisor`) stops what is left, starts new processes, and
its ``rejoin`` hook (the trainer's ``EngineChannelWeightSync``) reopens the weight channel with the sender and
receives the current weights; the unfinished samples then continue from their tokens, at most
``rollout.max_engine_restarts`` times over the run (:mod:`hpc_rlhf.rollout.engine_restart` says where in the
step and why). An engine that dies during a weight round is restarted too, within the same bound, where the
transport allows it (:mod:`hpc_rlhf.rollout.weight_round_failure`): over ``gloo`` the round goes on without it
(the sender skips it, this rank lets the rest of the round go by), the engine is left dead, and at its next
generation or service point the new engine gets the whole current round before it generates; over ``nccl`` a death
before the round's last bucket ends the job with a ``WeightRoundError`` naming the engine (the sender would be left
in its broadcast). Under ``ds.lora.sync=adapter`` no weight channel is involved: the new engine loads the base from
its model folder (training never changes it) and the last synced adapter again from its node-local folder
(:mod:`hpc_rlhf.rollout.vllm_lora`), before it generates; an engine that dies during an adapter load, or is found
dead at one, is restarted there the same way.

The restart supervision (lock, incarnations, hang detection, budget) and the fault tests' hooks live in
:mod:`hpc_rlhf.rollout.engine_supervision`; this class makes the vLLM calls. Everything that does not need vLLM
(environment isolation, payloads, request ids, the backend choice) is a pure helper, unit-tested without vLLM;
:mod:`hpc_rlhf.rollout.vllm_contract` checks every vLLM name used here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.resilience.fault_injection import fault_point
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, RolloutEngine
from hpc_rlhf.rollout.engine_restart import (
    EngineFailure,
    GenerationProgress,
    RejoinHook,
    RestartBudget,
    Slot,
    Submission,
    generate_with_restarts,
)
from hpc_rlhf.rollout.engine_supervision import FAULT_PHASE, ROUND_FAULT_PHASE, FaultHooks, RestartSupervisor
from hpc_rlhf.rollout.placeholder_tokens import cut_at_placeholders, read_placeholder_token_ids
from hpc_rlhf.rollout.vllm_api import PAUSE_MODE, resolve
from hpc_rlhf.rollout.vllm_external_launcher import (
    VllmEngineSpec,
    import_vllm,
    routes_from_vllm,
    sampled_logprobs,
    spec_engine_kwargs,
    vllm_sampling_kwargs,
)
from hpc_rlhf.rollout.vllm_images import require_vllm_images_supported, tokens_prompt_kwargs
from hpc_rlhf.rollout.vllm_lora import AdapterFolderLostError, VllmAdapterSlot
from hpc_rlhf.rollout.vllm_server_launch import (
    isolated_environ,
    run_shielded_loop,
    server_engine_kwargs,
    server_process_env,
)
from hpc_rlhf.rollout.weight_round_failure import receive_round
from hpc_rlhf.weight_sync.vllm_gloo_transfer import GLOO_BACKEND  # imports no vLLM
from hpc_rlhf.weight_sync.vllm_transfer_info import (
    TRANSFER_BACKENDS,
    bucket_update_info,
    transfer_backend,
    worker_init_info,
)
from hpc_rlhf.world.job_secret import JobSecretError, held_job_secret

log = logging.getLogger(__name__)
__all__ = ["FAULT_PHASE", "ROUND_FAULT_PHASE", "VllmServerEngine"]  # the fault phases: engine_supervision's
# How often a pending engine call checks that the engine is still alive (vLLM's engine-dead flag).
ROUND_POLL_S = 0.2
# The longest a best-effort call (resume, abort) waits for an engine that is alive but slow to answer.
BEST_EFFORT_CALL_S = 10.0

class VllmServerEngine(RolloutEngine):
    """vLLM's asynchronous engine in its own processes, driven from one rollout rank.

    Args:
        model_path: local HF model folder loaded by vLLM.
        tensor_parallel_size: worker processes (GPUs) of this engine.
        devices: node-local GPU indices for the workers (``None``: vLLM's default, the visible ones; on CPU
            machines always ``None``).
        seed: engine seed (per-request seeds make calls reproducible, as in the in-process engine).
        weight_transfer_backend: ``nccl`` or ``gloo`` (default: :func:`transfer_backend` of this machine); the
            sender must use the same one.
        lora: ``ds.lora`` under ``ds.lora.sync=adapter``: one LoRA adapter on every request, replaced by
            :meth:`update_adapter` (``hpc_rlhf.rollout.vllm_lora``; ``engine_kwargs`` must enable vLLM's LoRA, as
            ``spec_engine_kwargs`` does).
        engine_kwargs: further ``AsyncEngineArgs`` keywords (``dtype``, ``max_model_len``, ``kv_cache_memory_bytes``
            ...).
    """

    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, devices: Sequence[int] | None = None,
                 gpu_memory_utilization: float = 0.9, seed: int = 0, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True, logprobs_mode: str = "processed_logprobs",
                 weight_transfer_backend: str | None = None, lora: LoraConfig | None = None,
                 max_restarts: int = 0, timeout_s: float | None = None, name: str = "the vLLM rollout engine",
                 **engine_kwargs: Any) -> None:
        self.engine: Any = None  # vLLM's AsyncLLMEngine once started; close() is a no-op before
        self.adapter = VllmAdapterSlot(lora) if lora is not None else None
        import_vllm()  # the actionable install hint when vLLM is missing
        backend = weight_transfer_backend or transfer_backend(torch.cuda.is_available())
        if backend not in TRANSFER_BACKENDS:
            raise ValueError(f"VllmServerEngine: weight_transfer_backend={backend!r}; choose one of "
                             f"{TRANSFER_BACKENDS}")
        self.tensor_parallel_size = tensor_parallel_size
        self.weight_transfer_backend = backend
        self._channel_open = False  # open_weight_channel done: a sender can reach the workers
        self._request_ids = itertools.count()
        self.placeholder_ids = read_placeholder_token_ids(model_path)  # never sampled (vision-language models)
        self._in_flight: set[str] = set()  # request ids of generations not finished yet
        self._loop = asyncio.new_event_loop()
        # vLLM's processes are started from this thread and inherit its signal mask: SLURM's time-limit warning,
        # which reaches every process of the step, is for the rank to act on, not for them to die of.
        self._thread = threading.Thread(target=run_shielded_loop, args=(self._loop,), name="vllm-server-loop",
                                        daemon=True)
        self._thread.start()
        kwargs = server_engine_kwargs(model_path, tensor_parallel_size=tensor_parallel_size,
                                      gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                                      enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
                                      logprobs_mode=logprobs_mode, **engine_kwargs)
        kwargs["weight_transfer_config"] = resolve("vllm.config:WeightTransferConfig")(backend=backend)
        self._engine_args = resolve("vllm:AsyncEngineArgs")(**kwargs)
        self._devices = devices
        # Restarts (engine_supervision): the bound, the silence that counts as a hang, who reopens the weight channel.
        self.name = name
        self.supervisor = RestartSupervisor(self, max_restarts=max_restarts, timeout_s=timeout_s, name=name)
        self.faults = FaultHooks()  # fault tests only; the trainer sets faults.rank
        self._start_engine()

    @classmethod
    def from_spec(cls, spec: VllmEngineSpec, local_rank: int | None, **engine_kwargs: Any) -> VllmServerEngine:
        """Built by every rollout rank, one engine each: on its own GPU (``local_rank``), or on the host's cores
        where there is no GPU (``local_rank=None``: weights then come over gloo). Engine keywords (dtype, context
        length, KV cache size, the CPU head-size check) are the in-process engine's
        (``vllm_external_launcher.spec_engine_kwargs``); ``engine_kwargs`` override them. Engines spanning several
        GPUs (``devices``) need the other ranks of their group to build none: not arranged yet, so refused."""
        tp = spec.tensor_parallel_size
        if tp > 1:
            # Every rollout rank builds its engine; with tp > 1 only each group's leading rank may (the others'
            # GPUs are its workers'), which the rollout placement does not arrange yet.
            raise ValueError(f"rollout.vllm_mode=server_process runs one engine per rollout rank: "
                             f"rollout.tensor_parallel_size={tp} is not supported there yet; use 1, or a colocated "
                             "layout (train.colocate_all=true, vLLM's external launcher)")
        on_gpu = local_rank is not None
        kwargs = {**spec_engine_kwargs(spec, on_gpu), **engine_kwargs}
        engine = cls(spec.require_model_path(), tensor_parallel_size=tp,
                     devices=list(range(local_rank, local_rank + tp)) if local_rank is not None else None,
                     gpu_memory_utilization=spec.vllm.gpu_memory_utilization, seed=spec.seed,
                     enforce_eager=spec.vllm.enforce_eager, enable_prefix_caching=spec.vllm.enable_prefix_caching,
                     weight_transfer_backend=transfer_backend(on_gpu), lora=spec.lora, **kwargs)
        engine.max_context_len = kwargs.get("max_model_len")
        return engine

    async def _start(self, args: Any) -> Any:
        # Built on the loop that will drive it: AsyncLLM binds its output handler to the running loop.
        return resolve("vllm:AsyncLLMEngine.from_engine_args")(args)

    def _start_engine(self) -> None:
        # The gloo channel's workers seal their store with the job's secret; vLLM's NCCL channel needs none. An
        # engine built outside a job's world (no secret held) still generates; its workers refuse a channel.
        secret = None
        if self.weight_transfer_backend == GLOO_BACKEND:
            with contextlib.suppress(JobSecretError):
                secret = held_job_secret()
        with isolated_environ(server_process_env(dict(os.environ), self._devices, secret)):
            self.engine = self._run(self._start(self._engine_args))
        self.supervisor.heard()

    def _run(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ------------------------------------------------------------------ generation
    async def _stream_one(self, request: GenerationRequest, slots: list[Slot], progress: GenerationProgress) -> None:
        """One request, its tokens streamed into ``progress`` as vLLM samples them (``DELTA`` outputs), so that a
        restart keeps what came back (``engine_restart``)."""
        kwargs = vllm_sampling_kwargs(request.params, request.n, self.placeholder_ids)
        kwargs["output_kind"] = resolve("vllm.sampling_params:RequestOutputKind.DELTA")
        request_id = f"hpc-rlhf-{next(self._request_ids)}"
        require_vllm_images_supported([request], torch.cuda.is_available())
        prompt = resolve("vllm:TokensPrompt")(**tokens_prompt_kwargs(request))
        self._in_flight.add(request_id)
        try:
            async for output in self.engine.generate(prompt=prompt,
                                                     sampling_params=resolve("vllm:SamplingParams")(**kwargs),
                                                     request_id=request_id, **self._adapter_kwargs()):
                self.supervisor.heard()
                for completion in output.outputs:
                    index = getattr(completion, "index", 0)  # test doubles of one-sample outputs may leave it out
                    ids = [int(t) for t in completion.token_ids]
                    where = f"request {slots[index][0]} sample {slots[index][1]}"
                    logprobs = sampled_logprobs(ids, completion.logprobs, where) if ids else []
                    progress.record(slots[index], ids, logprobs, completion.finish_reason,
                                    getattr(completion, "routed_experts", None))
                if self.faults.take_hold():
                    # fault tests: hold the requests right after the first tokens came back (FaultHooks.hold)
                    await self.engine.pause_generation(mode=PAUSE_MODE, clear_cache=False)
                    self.faults.mark_paused()
        finally:
            self._in_flight.discard(request_id)

    async def _stream(self, submissions: list[Submission], progress: GenerationProgress) -> None:
        await asyncio.gather(*(self._stream_one(request, slots, progress) for request, slots in submissions))

    def submit(self, requests: list[GenerationRequest]) -> Future:
        """Start generating ``requests``; the future's result is ``generate(requests)``'s. Weight rounds
        (:meth:`receive_weights`) may run while it is pending. Runs on a thread of its own, so that a restart
        (:meth:`generate`) may wait for its weights."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self.generate(requests))
            except BaseException as err:  # noqa: BLE001 - handed to the future's owner
                future.set_exception(err)

        threading.Thread(target=run, name="vllm-server-submit", daemon=True).start()
        return future

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate ``requests``. When vLLM's processes die or stop answering (``timeout_s`` without a token), the
        engine is restarted (at most ``max_restarts`` times over the run), gets its weights again (:attr:`rejoin`)
        and the unfinished samples continue from the tokens that came back (``engine_restart``)."""
        if not requests:
            return []
        self.faults.generate_calls += 1
        results = generate_with_restarts(requests, self._attempt, self.restart, routes_from_vllm)
        cut_at_placeholders(results, self.placeholder_ids)  # the bias makes them ~impossible, not impossible
        return results

    def _attempt(self, submissions: list[Submission], progress: GenerationProgress) -> None:
        """One try at ``submissions`` on the current engine; raises :class:`EngineFailure` when it dies or is silent
        for ``timeout_s`` (outside weight rounds)."""
        lost = self.supervisor.round_failure
        if lost is not None:  # the engine died in the last weight round: restarted (whole round) before generating
            raise EngineFailure(lost.cause, lost.incarnation)
        incarnation = self.supervisor.incarnation
        dead_error = resolve("vllm.v1.engine.exceptions:EngineDeadError")
        fault = self.faults.arm(first_attempt=progress.attempts == 1)
        timeout_s = self.supervisor.timeout_s
        future = asyncio.run_coroutine_threadsafe(self._stream(submissions, progress), self._loop)
        while True:
            try:
                future.result(timeout=0.01 if fault else 1.0 if timeout_s is None else min(1.0, timeout_s))
                return
            except FutureTimeout:
                if fault and self.faults.paused():
                    self.faults.hold(fault, self._resume_after_fault)
                    fault = None
                    continue
                hang = self.supervisor.hang(incarnation)
                if hang is not None:
                    future.cancel()
                    raise hang from None
            except dead_error as err:
                raise EngineFailure(f"vLLM's engine-core process exited ({type(err).__name__}: {err})",
                                    incarnation) from err

    def _resume_after_fault(self) -> None:
        """Fault tests: the requests held for a fault point go on, unless the driver killed the engine (generate
        reports that; nothing to resume)."""
        self._call_unless_dead(self.engine.resume_generation())

    def restart(self, failure: EngineFailure) -> None:
        """Replace a failed engine and give it its weights again (:meth:`RestartSupervisor.restart`)."""
        self.supervisor.restart(failure)

    # ------------------------------------------------------------------ restarts: the supervisor's hooks
    def stop_processes(self) -> None:
        """Stop what is left of a failed engine's processes; its weight channel is gone with them."""
        self._stop_engine()
        self._channel_open = False

    def start_processes(self) -> None:
        """New processes, from the checkpoint's weights."""
        self._start_engine()

    def reload_adapter(self) -> EngineFailure | None:
        """``ds.lora.sync=adapter``, on a restarted engine: load the last adapter written to the node-local folder
        (the dead engine's, or the one it died loading) before anything generates; the new engine's requests then
        carry it under the same name and id. Returns the new engine's own death during that load, else None.
        Nothing before the first sync: the base is the policy then (``lora_B`` starts at zero). Raises
        :class:`AdapterFolderLostError` when the folder lost the adapter: nothing on this rank can restore it."""
        slot = self.adapter
        if slot is None or not slot.written:
            return None
        try:
            slot.require_files(self.name)
        except AdapterFolderLostError as err:
            self.supervisor.give_up(str(err))
            raise
        try:
            self._call_in_round(self.engine.add_lora(slot.load_request()), self.supervisor.incarnation)
        except EngineFailure as failure:
            return EngineFailure(f"while the restarted engine loaded the LoRA adapter again, {failure.cause}",
                                 failure.incarnation)
        slot.loaded = True
        return None

    def restored(self) -> str:
        """What a restarted engine got back, for the log."""
        if self.adapter is not None:
            if self.adapter.written:
                return f"the base, and the last synced LoRA adapter loaded again from {self.adapter.folder}"
            return "the base; no LoRA adapter synced yet, so the base is the policy"
        return "weights received again" if self._channel_open \
            else "no weight round yet: the checkpoint's weights are current"

    @property
    def budget(self) -> RestartBudget:
        """``rollout.max_engine_restarts`` and the restarts spent."""
        return self.supervisor.budget

    @property
    def restarts(self) -> int:
        """Restarts so far (``rollout/engine_restarts``)."""
        return self.supervisor.budget.restarts

    @property
    def timeout_s(self) -> float | None:
        """``rollout.engine_timeout_s``: silence that counts as a hang."""
        return self.supervisor.timeout_s

    @property
    def rejoin(self) -> RejoinHook | None:
        """Set by the trainer: reopens the weight channel of a restarted engine and sends it the current weights."""
        return self.supervisor.rejoin

    @rejoin.setter
    def rejoin(self, hook: RejoinHook | None) -> None:
        self.supervisor.rejoin = hook

    def alive(self) -> bool:
        """Whether vLLM's processes are up (a dead engine-core is noticed by vLLM within a fraction of a second) and
        did not die in the last weight round."""
        return self.engine is not None and not self.engine.errored and self.supervisor.round_failure is None

    def round_failure(self) -> EngineFailure | None:
        """The engine's death in the last weight round, until it is restarted (the cause names the round)."""
        return self.supervisor.round_failure

    def _stop_engine(self) -> None:
        """Stop a failed engine's processes (best effort: some are already gone)."""
        if self._in_flight:
            self._call_unless_dead(self.engine.abort(request_id=list(self._in_flight)))
            self._in_flight.clear()
        with contextlib.suppress(Exception):
            self._run_for(self._shutdown(), 60.0)
        self.engine = None

    def _run_for(self, coroutine: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout_s)

    def _await_while_alive(self, coroutine: Any, timeout_s: float | None = None) -> tuple[bool, Any]:
        """Run an engine call on the loop: ``(True, its result)``, or ``(False, None)`` once vLLM flags the engine
        dead (or after ``timeout_s``), the call then cancelled. vLLM 0.32 leaves a call pending for good when its
        engine core dies under it (it fails no pending utility call), and raises the engine-dead flag a moment after
        the death, so the flag is checked every ``ROUND_POLL_S`` while waiting, not once before the call. The call's
        own errors propagate."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return True, future.result(timeout=ROUND_POLL_S)
            except FutureTimeout:
                if self.engine.errored or (deadline is not None and time.monotonic() >= deadline):
                    future.cancel()
                    return False, None

    def _call_unless_dead(self, coroutine: Any) -> None:
        """A best-effort engine call (resume, abort), at most ``BEST_EFFORT_CALL_S``: its errors and a dead engine
        are the caller's to find out."""
        with contextlib.suppress(Exception):
            self._await_while_alive(coroutine, BEST_EFFORT_CALL_S)

    # ------------------------------------------------------------------ weights
    def open_weight_channel(self, rendezvous: Mapping[str, Any]) -> None:
        """Join this engine's workers to the communicator of their sender (collective with the sender's
        ``connect`` of ``vllm_nccl_transfer.SenderChannel`` or ``vllm_gloo_transfer.GlooSenderChannel``;
        ``rendezvous`` is that channel's, sent over the world's group). It reaches the workers through vLLM's control
        plane. Returns once the sender and every worker have joined."""
        request = resolve("vllm.distributed.weight_transfer.base:WeightTransferInitRequest")(
            init_info=worker_init_info(rendezvous, self.tensor_parallel_size, self.weight_transfer_backend))
        self._run(self.engine.init_weight_transfer_engine(request))
        self._channel_open = True

    def receive_weights(self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        """One weight round: each bucket's ``(name, tensor)`` pairs describe (names, dtypes, shapes; the tensors
        may be on ``meta``) what the sender broadcasts next over the engine's communicator, in that order. The round
        must cover every tensor of the model (vLLM's layerwise reload processes a layer once all its parts came).
        Requests in flight are paused, keep their tokens, and continue under the new weights.

        ``buckets`` is consumed on the calling thread, one bucket per transfer, so it may wait for a bucket's
        description (``hpc_rlhf.weight_sync.sharded`` receives them over the control plane on the first sync)
        without holding the engine's event loop.

        When the engine dies during the round (``weight_round_failure.receive_round``): over ``gloo`` the rest of
        ``buckets`` is consumed, the engine is left dead (:meth:`alive` is false, :meth:`round_failure` says why)
        and this returns; its next generation or service point restarts it, and the new engine gets the whole
        current round before it generates. Over ``nccl``, a death before the last bucket raises
        ``WeightRoundError``. Any other error propagates, generation resumed."""
        if not self._channel_open:
            raise RuntimeError("VllmServerEngine: no weight channel; the weights of an out-of-process engine come "
                               f"from an actor rank over {self.weight_transfer_backend} (a sender channel there, "
                               "open_weight_channel here), not through this rank")
        update_request = resolve("vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest")
        with self.supervisor.lock:  # a generation that sees the engine die restarts it once the round is over
            point = self.faults.round_point()
            incarnation = self.supervisor.incarnation
            told = 0  # buckets the engine was told about

            def begin() -> None:
                self._call_in_round(self.engine.pause_generation(mode=PAUSE_MODE, clear_cache=True), incarnation)
                self._call_in_round(self.engine.start_weight_update(), incarnation)

            def load(bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
                nonlocal told
                info = bucket_update_info(bucket)
                if info["names"]:
                    if not told:
                        fault_point(*point)  # fault tests kill the engine core here
                    told += 1
                    self._call_in_round(self.engine.update_weights(update_request(update_info=info)), incarnation)

            def finish() -> None:
                self._call_in_round(self.engine.finish_weight_update(), incarnation)
                self._call_in_round(self.engine.resume_generation(), incarnation)

            with self.supervisor.generation_held():
                try:
                    failure = receive_round(buckets, begin=begin, load=load, finish=finish, engine_name=self.name,
                                            backend=self.weight_transfer_backend)
                except BaseException:
                    if self.alive():  # a failed round still resumes generation; the round's error is the one reported
                        self._call_unless_dead(self.engine.resume_generation())
                    raise
            if failure is not None:
                self.supervisor.round_failure = failure
                log.warning("%s died %s; the rest of the round went by without it, and it is restarted, with the "
                            "whole current round, before it generates again", self.name, failure.cause)

    def _call_in_round(self, coroutine: Any, incarnation: int) -> Any:
        """One engine call of a weight round; raises :class:`EngineFailure` when the engine dies meanwhile
        (:meth:`_await_while_alive`)."""
        dead_error = resolve("vllm.v1.engine.exceptions:EngineDeadError")
        try:
            returned, result = self._await_while_alive(coroutine)
        except dead_error as err:
            raise EngineFailure(f"vLLM's engine-core process exited ({type(err).__name__}: {err})",
                                incarnation) from err
        if not returned:
            raise EngineFailure("vLLM's engine-core process exited", incarnation)
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A round of one bucket (the sender broadcasts exactly these tensors)."""
        self.receive_weights([named_tensors])

    def _adapter_kwargs(self) -> dict[str, Any]:
        """``generate``'s keyword of the adapter every request carries (none without adapter sync)."""
        return {"lora_request": self.adapter.request} if self.adapter is not None else {}

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """``ds.lora.sync=adapter``: the adapter (received over the main world, ``hpc_rlhf.weight_sync.adapter``)
        written to this engine's node-local folder and loaded again in place, requests in flight paused (kept)
        meanwhile, as in a weight round. Returns the adapter's bytes.

        An engine found dead here (it died while idle: adapter sync has no service point that would have noticed)
        or that dies during the load is restarted, within ``max_restarts``, and the new engine loads this adapter
        from the folder before it generates (:meth:`restart`). Holds the restart lock throughout, so a generation
        that sees the engine die restarts it only once the folder holds this adapter."""
        if self.adapter is None:
            raise RuntimeError("VllmServerEngine.update_adapter: the engine was built without a LoRA adapter "
                               "(ds.lora.sync resolved to merged)")
        with self.supervisor.lock:
            num_bytes = self.adapter.write(named_tensors)  # from here on a restart loads this adapter
            failure = self._load_adapter(self.adapter) if self.alive() else self.round_failure() or EngineFailure(
                "vLLM's engine-core process exited while the engine was idle, found at a LoRA adapter sync",
                self.supervisor.incarnation)
            if failure is not None:
                self.restart(failure)
        return num_bytes

    def _load_adapter(self, slot: VllmAdapterSlot) -> EngineFailure | None:
        """Load the folder's adapter in place, generation paused (kept) meanwhile. Returns the engine's death during
        the load (vLLM may leave a call pending for good then: ``_call_in_round`` watches its engine-dead flag);
        any other error propagates, generation resumed."""
        incarnation = self.supervisor.incarnation
        try:
            with self.supervisor.generation_held():
                self._call_in_round(self.engine.pause_generation(mode=PAUSE_MODE, clear_cache=True), incarnation)
                try:
                    self._call_in_round(self.engine.add_lora(slot.load_request()), incarnation)
                except Exception as err:
                    if not isinstance(err, EngineFailure) and self.alive():  # an adapter vLLM refused: as is
                        self._call_in_round(self.engine.resume_generation(), incarnation)
                    raise
                self._call_in_round(self.engine.resume_generation(), incarnation)
        except EngineFailure as failure:
            # (noticed here: it may have died while idle before this sync, vLLM's engine-dead flag not set yet)
            return EngineFailure(f"at a LoRA adapter load, {failure.cause}", incarnation)
        slot.loaded = True
        return None

    def sleep(self) -> None:
        """No-op: this engine owns its GPUs (no training states share them)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op, see :meth:`sleep`."""

    def reset_prefix_cache(self) -> None:
        if self.alive():  # an engine lost in a weight round is restarted with empty caches
            self._run(self.engine.reset_prefix_cache())

    async def _drained(self, timeout_s: float) -> None:
        """Wait until every aborted generation has returned its last output."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        """Abort what is in flight (pending ``submit`` futures then fail instead of waiting forever), stop vLLM's
        processes and the loop thread. Idempotent; the engine is not usable afterwards."""
        if self.adapter is not None:
            self.adapter.remove()
        if self.engine is None:
            return
        if not self.alive():
            self._stop_engine()  # what is left of a dead engine (e.g. one lost in the run's last weight round)
        else:
            if self._in_flight:
                self._run(self.engine.abort(request_id=list(self._in_flight)))
                self._run(self._drained(timeout_s=30.0))
            self._run(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()
        # Released now, while the interpreter is whole: vLLM's finaliser would otherwise run at exit, when the
        # modules it calls are gone, and print a TypeError.
        self.engine = None

    async def _shutdown(self) -> None:
        # On the engine's loop: vLLM stops its engine core before cancelling its output handler, which, if it ran in
        # between, would report the stopped core as an engine failure.
        self.engine.shutdown()
