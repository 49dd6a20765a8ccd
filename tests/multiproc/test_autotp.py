"""DeepSpeed AutoTP (``ds.tensor_parallel_size=2``) on 2 gloo ranks with a tiny fp32 Llama (CPU).

Tensor parallelism must not change the maths: the same data gives the same losses and weights as one rank
holding the whole model, while each rank really holds half of every sharded matrix. The tiny model has
attention and MLP biases and an untied LM head so that column-parallel biases (gathered), row-parallel
biases (replicated) and a column-parallel LM head are all exercised; the RL run uses the tied tiny model.
"""

from __future__ import annotations

import os
import traceback
from functools import partial

import pytest
import torch

from hpc_rlhf.config.schema import ActorConfig, DeepSpeedConfig, LoraConfig, RefConfig
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks
from tests.multiproc.test_deepspeed_engine import _gathered  # several small buckets, duplicate-name check

pytestmark = pytest.mark.slow
os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB = 64
SEQ = 16
NUM_STEPS = 3
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _build_model(path: str) -> str:
    """Save (once) a tiny Llama with biases and an untied LM head, like a real checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # HF initialises biases to zero; make them visible to the gather checks
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.02)
        model.save_pretrained(path)
    return path


def _load(path: str):
    from hpc_rlhf.models.loading import load_causal_lm

    return load_causal_lm(path, torch.float32, "eager")


def _batches(rank_independent_seed: int = 0) -> list[torch.Tensor]:
    """The same two micro-batches on every rank: tp peers must see identical inputs."""
    gen = torch.Generator().manual_seed(rank_independent_seed)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2)]


def _engine(path: str, stage: int, tp_size: int, tp_group, dp_group, lora_rank: int = 0):
    """Two micro-batches of 2 rows per optimizer step on every rank, whatever the dp size."""
    import torch.distributed as dist

    from hpc_rlhf.training.deepspeed_engine import TrainEngine

    ds = DeepSpeedConfig(zero_stage=stage, tensor_parallel_size=tp_size, lora=LoraConfig(rank=lora_rank))
    return TrainEngine.create(partial(_load, path), ds, ActorConfig(learning_rate=1e-2, lr_warmup_ratio=0.0,
                                                                    min_lr_ratio=0.1, max_norm=1.0),
                              train_batch_size=4 * dist.get_world_size(dp_group), micro_train_batch_size=2,
                              num_training_steps=8,
                              dp_group=dp_group, tp_group=tp_group if tp_size > 1 else None, on_gpu=False,
                              extra_ds_config=SHARD_ALL if stage == 3 else None)


def _train(engine, steps: int = NUM_STEPS, seed: int = 0) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps of two micro-batches each; (per-step mean losses, grad norms)."""
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for input_ids in _batches(seed):  # the same data every step: the loss must fall
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss / 2)  # the step loss is the mean over its two micro-batches
            info = engine.step()
            total += loss.item() / 2
        losses.append(total)
        norms.append(info["grad_norm"])
    return losses, norms


def _numpy(state: dict[str, torch.Tensor]) -> dict:
    return {k: v.numpy() for k, v in state.items()}  # plain pickles through the Manager


def _local_shapes(engine) -> dict[str, tuple[int, ...]]:
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}


def _suite_worker(rank: int, world_size: int, base: str, stage: int) -> dict:
    """tp=1 and tp=2 engines on the same data, then save_hf and a checkpoint round trip of the tp=2 one.

    One spawn for all of it: importing deepspeed + transformers dominates the cost. tp=1 is data parallel
    over both ranks with the same data on each (so the same maths as one rank), tp=2 shards over both ranks.
    """
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    tp_group = dist.new_group(list(range(world_size)))
    path = _build_model(os.path.join(base, "model")) if rank == 0 else None
    dist.barrier()
    path = os.path.join(base, "model")
    out: dict = {}
    try:
        single = _engine(path, stage, 1, None, None)
        out["tp1_losses"], out["tp1_norms"] = _train(single)
        out["tp1_final"] = _numpy(_gathered(single))

        engine = _engine(path, stage, 2, tp_group, singles[rank])
        out["shapes"] = _local_shapes(engine)
        out["initial"] = _numpy(_gathered(engine))
        reference = _load(path).state_dict()
        out["reference_keys"] = sorted(reference)
        out["initial_max_diff"] = max(abs(out["initial"][k] - reference[k].numpy()).max() for k in reference)
        out["losses"], out["norms"] = _train(engine)
        final = _gathered(engine)
        out["final"] = _numpy(final)
        out["still_shards"] = _local_shapes(engine) == out["shapes"]  # gathering put the shards back

        hf_dir = os.path.join(base, f"hf{stage}")
        engine.save_hf(hf_dir)
        if rank == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
            out["hf_max_diff"] = max((loaded[k] - final[k]).abs().max().item() for k in final)
            out["hf_keys"] = sorted(loaded)

        # Checkpoint round trip: save, one more step (expected), then a fresh engine loads and takes it.
        ckpt_dir = os.path.join(base, f"ckpt{stage}")
        engine.save_checkpoint(ckpt_dir, tag="t", client_state={"rank": rank})
        _train(engine, steps=1, seed=100)
        expected = _gathered(engine)
        resumed_engine = _engine(path, stage, 2, tp_group, singles[rank])
        client_state = resumed_engine.load_checkpoint(ckpt_dir, tag="t")
        _train(resumed_engine, steps=1, seed=100)
        resumed = _gathered(resumed_engine)
        out["ckpt_rank"] = client_state["rank"]
        out["ckpt_max_diff"] = max((expected[k] - resumed[k]).abs().max().item() for k in expected)
        out["ckpt_steps"] = resumed_engine.global_steps
    except Exception:  # report it; a failure inside a collective still times out the run
        out["error"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module", params=[0, 3], ids=["zero0", "zero3"])
def suite(request, tmp_path_factory):
    results = run_on_ranks(_suite_worker, 2, str(tmp_path_factory.mktemp("autotp")), request.param)
    for rank, res in enumerate(results):
        if "error" in res:
            pytest.fail(f"rank {rank} failed:\n{res['error']}")
    return request.param, results


def test_tp2_trains_like_tp1_with_sharded_parameters(suite):
    _, results = suite
    for res in results:
        shapes = res["shapes"]
        # column parallel (output dim halved, bias too), row parallel (input dim halved, bias replicated)
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (16, 32)
        assert shapes["model.layers.0.self_attn.q_proj.bias"] == (16,)
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (8, 32)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (32, 16)
        assert shapes["model.layers.0.self_attn.o_proj.bias"] == (32,)
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (32, 32)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (32, 32)
        assert shapes["lm_head.weight"] == (32, 32)  # column parallel over the vocabulary
        assert res["still_shards"]
        torch.testing.assert_close(res["losses"], res["tp1_losses"], rtol=1e-5, atol=1e-5)
        assert res["losses"][-1] < res["losses"][0]
        # clipping (max_norm=1) is active, so equal losses also mean the TP-aware norm is right
        torch.testing.assert_close(res["norms"], res["tp1_norms"], rtol=1e-4, atol=1e-5)
        assert all(n > 1.0 for n in res["norms"][:1]), res["norms"]


def test_gathered_state_dict_is_the_full_model(suite):
    _, results = suite
    for res in results:
        initial, final, tp1 = res["initial"], res["final"], res["tp1_final"]
        assert sorted(initial) == res["reference_keys"] == sorted(tp1)
        assert res["initial_max_diff"] == 0.0  # before training: exactly the checkpoint's full tensors
        for name in tp1:
            assert initial[name].shape == tp1[name].shape, name
            torch.testing.assert_close(torch.from_numpy(final[name]), torch.from_numpy(tp1[name]), rtol=1e-4,
                                       atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    first, second = results
    for name in first["final"]:  # both tp ranks hand out the same full weights
        assert (first["final"][name] == second["final"][name]).all(), name


def test_save_hf_reloads_the_trained_weights(suite):
    _, results = suite
    assert results[0]["hf_max_diff"] == 0.0
    assert sorted(results[0]["hf_keys"]) == sorted(results[0]["final"])


def test_checkpoint_round_trip_with_tp(suite):
    _, results = suite
    for rank, res in enumerate(results):
        assert res["ckpt_rank"] == rank
        assert res["ckpt_steps"] == NUM_STEPS + 1
        assert res["ckpt_max_diff"] < 1e-6, res["ckpt_max_diff"]


# --------------------------------------------------------------------------------------------------
# 4 ranks: tp=2 inside, ZeRO data parallelism over 2 replicas


def _tp_dp_worker(rank: int, world_size: int, base: str) -> dict:
    """tp groups {0,1} {2,3}, dp groups {0,2} {1,3}: replica 0 trains on data A, replica 1 on data B. The
    reference is plain data parallelism over 4 ranks with A on ranks 0-1 and B on ranks 2-3: the same
    average gradient. Then the combinations the engine must refuse, before any collective."""
    import torch.distributed as dist

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    misaligned = dist.new_group([1, 2])
    singles = [dist.new_group([r]) for r in range(world_size)]
    path = _build_model(os.path.join(base, "model")) if rank == 0 else None
    dist.barrier()
    path = os.path.join(base, "model")
    replica = rank // 2
    out: dict = {}
    try:
        for stage in (1, 2, 3):
            reference = _engine(path, stage, 1, None, None)
            out[f"ref{stage}"] = _train(reference, steps=2, seed=10 * replica)[0]
            engine = _engine(path, stage, 2, tp_groups[replica], dp_groups[rank % 2])
            out[f"zero{stage}"] = engine.engine.zero_optimization_stage()
            out[f"tp{stage}"] = _train(engine, steps=2, seed=10 * replica)[0]
            out[f"diff{stage}"] = max((a - b).abs().max().item() for a, b in
                                      zip(_gathered(reference).values(), _gathered(engine).values(), strict=True))
            del reference, engine
        errors = {}
        for name, call in (
                ("lora", lambda: _engine(path, 2, 2, tp_groups[replica], dp_groups[rank % 2], lora_rank=4)),
                ("misaligned", lambda: _engine(path, 2, 2, misaligned, singles[rank])),
                ("zero3_subset", lambda: _engine(path, 3, 2, tp_groups[0], singles[rank]))):
            if name == "misaligned" and rank not in (1, 2) or name == "zero3_subset" and rank > 1:
                continue
            try:
                call()
                errors[name] = None
            except ValueError as exc:
                errors[name] = str(exc)
        out["errors"] = errors
    except Exception:
        out["error"] = traceback.format_exc()
    return out


def test_tp2_composes_with_zero_data_parallelism_on_4_ranks(tmp_path):
    results = run_on_ranks(_tp_dp_worker, 4, str(tmp_path))
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        for stage in (1, 2, 3):
            assert res[f"zero{stage}"] == stage
            torch.testing.assert_close(res[f"tp{stage}"], res[f"ref{stage}"], rtol=1e-5, atol=1e-5)
            assert res[f"diff{stage}"] < 1e-4, (stage, res[f"diff{stage}"])  # Adam amplifies round-off
        errors = res["errors"]
        assert "ds.lora.rank" in errors["lora"] and "ds.tensor_parallel_size" in errors["lora"]
        if rank in (1, 2):
            assert "consecutive" in errors["misaligned"]
        if rank in (0, 1):
            assert "ds.zero_stage=3" in errors["zero3_subset"]


# --------------------------------------------------------------------------------------------------
# frozen roles and a value model


def _frozen_and_critic_worker(rank: int, world_size: int, base: str, stage: int, groups=None) -> dict:
    """A reference model and a reward model (FrozenEngine) and a critic (TrainEngine), all tp=2, seeded apart
    like the trainers seed their ranks: the value head missing from the checkpoint starts random. ``groups``:
    ``(tp group, one-rank dp groups)`` made by the caller; made here when None."""
    import torch.distributed as dist

    from hpc_rlhf.models.forward import sequence_scores, token_values
    from hpc_rlhf.models.loading import load_value_model
    from hpc_rlhf.training.deepspeed_engine import FrozenEngine, TrainEngine

    torch.manual_seed(1234 + rank)
    tp_group, singles = groups or (dist.new_group([0, 1]), [dist.new_group([r]) for r in range(world_size)])
    path = _build_model(os.path.join(base, "model")) if rank == 0 else None
    dist.barrier()
    path = os.path.join(base, "model")
    value_factory = partial(load_value_model, path, torch.float32, "eager")
    ds = DeepSpeedConfig(zero_stage=stage, tensor_parallel_size=2)
    extra = SHARD_ALL if stage == 3 else None
    input_ids = _batches(7)[0]
    mask = torch.ones_like(input_ids)
    out: dict = {}
    try:
        ref = FrozenEngine.create(partial(_load, path), ds, RefConfig(), micro_batch_size=2, dp_group=singles[rank],
                                  tp_group=tp_group, on_gpu=False, extra_ds_config=extra)
        plain = _load(path).eval()
        with torch.no_grad():
            out["ref_logits_diff"] = (ref(input_ids=input_ids).logits - plain(input_ids=input_ids).logits
                                      ).abs().max().item()
        q_proj = ref.module.model.layers[0].self_attn.q_proj.weight
        out["ref_sharded"] = tuple(getattr(q_proj, "ds_shape", q_proj.shape)) == (16, 32)

        reward = FrozenEngine.create(value_factory, ds, RefConfig(), micro_batch_size=2, dp_group=singles[rank],
                                     tp_group=tp_group, on_gpu=False, extra_ds_config=extra)
        critic = TrainEngine.create(value_factory, ds, ActorConfig(learning_rate=1e-3), train_batch_size=2,
                                    micro_train_batch_size=2, num_training_steps=2, dp_group=singles[rank],
                                    tp_group=tp_group, on_gpu=False, extra_ds_config=extra)
        for name, engine in (("reward", reward), ("critic", critic)):
            state = _gathered(engine)
            out[f"{name}_score"] = state["score.weight"].numpy()
            twin = load_value_model(path, torch.float32, "eager")
            twin.load_state_dict(state)
            with torch.no_grad():
                expected = sequence_scores(twin.eval(), input_ids, mask)
                got = sequence_scores(engine.module, input_ids, mask)
            out[f"{name}_score_diff"] = (got - expected).abs().max().item()
        values = token_values(critic.module, input_ids, mask)
        critic.backward(values.pow(2).mean())
        out["critic_grad_norm"] = critic.step()["grad_norm"]
        out["critic_score_after"] = _gathered(critic)["score.weight"].numpy()
    except Exception:
        out["error"] = traceback.format_exc()
    return out


def _frozen_and_critic_both_stages(rank: int, world_size: int, base: str) -> dict:
    """ZeRO-0 and ZeRO-3 in one spawn (importing deepspeed + transformers dominates a spawn's cost); each stage
    builds its own engines in a folder of its own, over the same groups (DeepSpeed keeps the tensor-parallel
    group process-global: a second one is refused)."""
    import torch.distributed as dist

    groups = (dist.new_group([0, 1]), [dist.new_group([r]) for r in range(world_size)])
    return {stage: _frozen_and_critic_worker(rank, world_size, os.path.join(base, f"zero{stage}"), stage, groups)
            for stage in (0, 3)}


@pytest.fixture(scope="module")
def frozen_and_critic(tmp_path_factory):
    return run_on_ranks(_frozen_and_critic_both_stages, 2, str(tmp_path_factory.mktemp("frozen")))


@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_roles_and_critic_with_tp2(frozen_and_critic, stage):
    results = [per_stage[stage] for per_stage in frozen_and_critic]
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert res["ref_sharded"]
        assert res["ref_logits_diff"] < 1e-5
        assert res["reward_score_diff"] < 1e-5 and res["critic_score_diff"] < 1e-5
        assert res["critic_grad_norm"] > 0
    first, second = results
    for key in ("reward_score", "critic_score", "critic_score_after"):  # replicated: the same on every tp rank
        assert (first[key] == second[key]).all(), key


# --------------------------------------------------------------------------------------------------
# one RL run end to end


def _grpo_worker(rank: int, world_size: int, overrides: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    trainer = run_trainer(rank, world_size, overrides)
    initial = {n: t.clone() for n, t in trainer.roles.rollout.engine.model.state_dict().items()}
    rows = trainer.fit()  # ends with a weight sync per step, then the HF export
    actor = {n: t for bucket in trainer.roles.actor.gathered_state_dict_items() for n, t in bucket}
    rollout = trainer.roles.rollout.engine.model.state_dict()
    exported = AutoModelForCausalLM.from_pretrained(trainer.cfg.train.output_dir + "/model",
                                                    dtype=torch.float32).state_dict()
    return {
        "num_rows": len(rows) if rank == 0 else None,
        "q_shape": tuple(trainer.roles.actor.module.model.layers[0].self_attn.q_proj.weight.shape),
        "full_q_shape": tuple(actor["model.layers.0.self_attn.q_proj.weight"].shape),
        "missing": sorted(set(actor) - set(rollout)),
        "rollout_diff": max((rollout[n] - t).abs().max().item() for n, t in actor.items()),
        "export_diff": max((exported[n] - t).abs().max().item() for n, t in actor.items()),
        "changed": sorted(n for n, t in actor.items() if not torch.equal(t, initial[n])),
        "names": sorted(actor),
    }


def test_grpo_colocated_with_tp2_syncs_full_weights(tmp_path):
    assets = make_assets(tmp_path / "assets")
    overrides = grpo_overrides(assets, tmp_path / "run", "ds.tensor_parallel_size=2", "train.max_steps=2")
    results = run_on_ranks(_grpo_worker, 2, overrides)
    assert results[0]["num_rows"] == 2
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    for res in results:
        assert res["q_shape"][0] * 2 == res["full_q_shape"][0]  # the actor trains sharded
        assert res["missing"] == []
        assert res["rollout_diff"] == 0.0  # the rollout engine holds exactly the gathered actor
        assert res["export_diff"] == 0.0
        assert res["changed"] == res["names"], "every actor tensor moved in two steps"


def _disaggregated_worker(rank: int, world_size: int, overrides: list[str]) -> dict:
    trainer = run_trainer(rank, world_size, overrides)
    trainer.fit()
    out = {"roles": trainer.world.placement.roles_of(rank)}
    if trainer.roles.actor is not None:
        out["actor"] = _numpy(_gathered(trainer.roles.actor))
    if trainer.roles.ref is not None:
        q_proj = trainer.roles.ref.module.model.layers[0].self_attn.q_proj.weight
        out["ref_q_rows"] = q_proj.shape[0]
    if trainer.roles.rollout is not None:
        out["rollout"] = _numpy(trainer.roles.rollout.engine.model.state_dict())
    return out


def test_grpo_disaggregated_tp2_roles_on_rank_subsets(tmp_path):
    """actor on ranks 0-1 and ref on ranks 2-3, each tp=2; rollout alone on rank 4: DeepSpeed must not build
    groups over the world, and the rollout rank receives the full actor weights by broadcast."""
    assets = make_assets(tmp_path / "assets")
    overrides = grpo_overrides(assets, tmp_path / "run", "ds.tensor_parallel_size=2", "train.colocate_all=false",
                               "actor.num_ranks=2", "ref.num_ranks=2", "rollout.num_engines=1",
                               "algo.kl.init_coef=0.01", "algo.kl.use_loss=true", "train.max_steps=2")
    results = run_on_ranks(_disaggregated_worker, 5, overrides)
    assert [r["roles"] for r in results] == [["actor"], ["actor"], ["ref"], ["ref"], ["rollout"]]
    assert results[2]["ref_q_rows"] * 2 == results[0]["actor"]["model.layers.0.self_attn.q_proj.weight"].shape[0]
    actor, rollout = results[0]["actor"], results[4]["rollout"]
    for name, tensor in actor.items():
        assert (results[1]["actor"][name] == tensor).all(), name
        assert (rollout[name] == tensor).all(), name
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and "kl_loss" in rows[-1]


# --------------------------------------------------------------------------------------------------
# supervised trainers


def _sft_worker(rank: int, world_size: int, base: str, tp_size: int) -> dict:
    import torch.distributed as dist

    from hpc_rlhf.config.supervised import load_supervised_config
    from hpc_rlhf.data.synthetic_preference import prepare_supervised_assets
    from hpc_rlhf.trainers.offline.sft import SFTTrainer

    overrides = [f"model.pretrain={base}/tiny-model", f"data.train_data=[{base}/sft_train.jsonl]",
                 f"data.eval_data=[{base}/sft_eval.jsonl]", f"train.output_dir={base}/sft_tp{tp_size}",
                 "train.max_steps=3", "train.eval_steps=100", f"ds.tensor_parallel_size={tp_size}"]
    cfg = load_supervised_config("sft", ROOT / "configs/sft_tiny_cpu.yaml", overrides)
    if rank == 0:
        prepare_supervised_assets(cfg)
    dist.barrier()
    trainer = SFTTrainer(cfg)
    rows = trainer.fit()
    q_proj = trainer.engine.module.model.layers[0].self_attn.q_proj.weight
    return {"rows": rows if rank == 0 else None, "q_rows": q_proj.shape[0], "dp_size": trainer.dp_size}


def test_sft_with_tp2_matches_data_parallel(tmp_path):
    tp1 = run_on_ranks(_sft_worker, 2, str(tmp_path), 1)
    tp2 = run_on_ranks(_sft_worker, 2, str(tmp_path), 2)
    assert [r["dp_size"] for r in tp1] == [2, 2] and [r["dp_size"] for r in tp2] == [1, 1]
    assert tp2[0]["q_rows"] * 2 == tp1[0]["q_rows"]
    for key in ("loss", "eval_loss"):
        ref = [r[key] for r in tp1[0]["rows"] if key in r]
        got = [r[key] for r in tp2[0]["rows"] if key in r]
        assert len(ref) == len(got) > 0, key
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
