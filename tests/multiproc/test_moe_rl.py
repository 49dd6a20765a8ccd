"""GRPO, SFT, DPO, KTO and the reward model on a tiny mixture-of-experts model (transformers' Qwen3-MoE /
Mixtral) on 2 gloo ranks under ZeRO-2 and ZeRO-3, with the load-balancing loss in the loss and the routing
statistics logged every step."""

from __future__ import annotations

import pytest

from hpc_rlhf.models.tiny import build_tiny_moe_model
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_each_on_ranks, run_on_ranks
from tests.multiproc.test_supervised_trainers import _fit as _fit_supervised
from tests.multiproc.test_supervised_trainers import _overrides as _supervised_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("assets")
    out = make_assets(base)
    out["qwen3_moe"] = str(build_tiny_moe_model(base / "tiny-qwen3-moe", family="qwen3_moe", seed=0))
    out["mixtral"] = str(build_tiny_moe_model(base / "tiny-mixtral", family="mixtral", seed=0))
    return out


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()


def _moe_overrides(assets, tmp_path, family: str, *extra: str) -> list[str]:
    return grpo_overrides(assets, tmp_path, f"actor.pretrain={assets[family]}", "algo.aux_loss_coef=0.01", *extra)


def _check_moe_rows(rows: list[dict]) -> None:
    for row in rows:
        for key in ("aux_loss", "moe/router_entropy", "moe/load_max_over_mean", "moe/layer0/load_max_over_mean",
                    "moe/layer1/load_max_over_mean"):
            assert key in row, (row["step"], key)
        assert row["aux_loss"] > 0 and 1.0 <= row["moe/load_max_over_mean"] <= 4.0  # 4 experts
        # algo.routing_replay=measure (the default) or rollout: the engine recorded routes, the trainer compared
        assert 0.0 <= row["moe/route_mismatch"] <= 1.0 and "moe/route_mismatch_layer_mean" in row


def test_grpo_qwen3_moe_zero2_reward_rises(assets, tmp_path):
    run_on_ranks(_fit, 2, _moe_overrides(assets, tmp_path, "qwen3_moe", "train.max_steps=30",
                                         "algo.routing_replay=rollout"))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.15, (first, last)
    _check_moe_rows(rows)


PPO = ("algo.advantage_estimator=gae", "rollout.n_samples_per_prompt=1", "rollout.rollout_batch_size=64",
       "algo.kl.init_coef=0.01")


ZERO3_RUNS = {"mixtral": ("mixtral", False, ()), "qwen3-packed": ("qwen3_moe", True, ()),
              "ppo": ("qwen3_moe", False, PPO)}


@pytest.fixture(scope="module")
def zero3_runs(assets, tmp_path_factory):
    """Every ZERO3_RUNS run in one spawn; ``{id: output folder}``."""
    base = tmp_path_factory.mktemp("zero3")
    run_each_on_ranks(_fit, 2, {
        run_id: (_moe_overrides(assets, base / run_id, family, "train.max_steps=3", "ds.zero_stage=3",
                                f"train.packing_samples={str(packed).lower()}", *algo),)
        for run_id, (family, packed, algo) in ZERO3_RUNS.items()})
    return {run_id: base / run_id for run_id in ZERO3_RUNS}


@pytest.mark.parametrize("run_id", list(ZERO3_RUNS))
def test_grpo_moe_zero3_finishes(zero3_runs, run_id):
    """GRPO, and PPO with an MoE critic (a sequence-classification head on the same MoE model) and a KL
    reference, all three roles under zero.Init."""
    algo = ZERO3_RUNS[run_id][2]
    rows = read_metrics(zero3_runs[run_id])
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_moe_rows(rows)
    if algo:
        assert all("critic_loss" in r and "kl" in r for r in rows)


def test_grpo_moe_sequence_parallel_with_routing_replay(assets, tmp_path):
    """Ring attention over both ranks (ds.ring_attn_size=2): each rank routes and replays its chunk of the
    sequence; the load-balancing loss and the routing statistics are the whole forward's
    (tests/multiproc/test_sequence_parallel.py checks them against the unsplit forward)."""
    run_on_ranks(_fit, 2, _moe_overrides(assets, tmp_path, "qwen3_moe", "ds.ring_attn_size=2", "train.max_steps=3",
                                         "algo.routing_replay=rollout"))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_moe_rows(rows)
    assert rows[0]["moe/route_mismatch"] == 0.0


def _sft(rank, world_size, overrides):
    from hpc_rlhf.config.supervised import load_supervised_config
    from hpc_rlhf.data.synthetic_preference import prepare_supervised_assets
    from hpc_rlhf.trainers.offline.sft import SFTTrainer

    cfg = load_supervised_config("sft", None, overrides)
    if rank == 0:
        prepare_supervised_assets(cfg)
    import torch.distributed as dist

    dist.barrier()
    SFTTrainer(cfg).fit()


SFT_RUNS = {"zero2-packed": (2, True), "zero3": (3, False)}


@pytest.fixture(scope="module")
def sft_runs(assets, tmp_path_factory):
    """Every SFT_RUNS run in one spawn; ``{id: output folder}``."""
    base = tmp_path_factory.mktemp("sft")

    def overrides(folder, zero_stage, packing):
        return [f"model.pretrain={assets['qwen3_moe']}", "data.synthetic_task=sft_arithmetic",
                f"data.train_data=[{folder / 'train.jsonl'}]", f"data.eval_data=[{folder / 'eval.jsonl'}]",
                "data.synthetic_num_samples=64", "data.synthetic_eval_samples=8", "data.max_len=32",
                "train.train_batch_size=16", "train.micro_train_batch_size=4", "train.max_steps=3",
                f"train.packing_samples={str(packing).lower()}", f"ds.zero_stage={zero_stage}",
                f"train.output_dir={folder / 'run'}", "loss.aux_loss_coef=0.01", "logger.use_tensorboard=false"]

    run_each_on_ranks(_sft, 2, {run_id: (overrides(base / run_id, *run),) for run_id, run in SFT_RUNS.items()})
    return {run_id: base / run_id / "run" for run_id in SFT_RUNS}


@pytest.mark.parametrize("run_id", list(SFT_RUNS))
def test_sft_moe_trains_with_the_aux_loss(sft_runs, run_id):
    rows = [r for r in read_metrics(sft_runs[run_id]) if "loss" in r]
    assert len(rows) == 3 and all(r["aux_loss"] > 0 and "moe/router_entropy" in r for r in rows)


PREFERENCE_RUNS = {"dpo-zero3": ("dpo", False, 3), "kto-packed-zero3": ("kto", True, 3), "rm-zero3": ("rm", False, 3),
                   "dpo-packed-zero0": ("dpo", True, 0)}


@pytest.fixture(scope="module")
def preference_runs(tmp_path_factory):
    """Every PREFERENCE_RUNS run in one spawn, each in a folder of its own; ``{id: output folder}``."""
    base = tmp_path_factory.mktemp("preference")
    run_each_on_ranks(_fit_supervised, 2, {
        run_id: (kind, _supervised_overrides(base / run_id, kind, "model.build_tiny=qwen3_moe",
                                             f"ds.zero_stage={zero_stage}", "train.max_steps=3",
                                             "loss.aux_loss_coef=0.01",
                                             f"train.packing_samples={str(packing).lower()}"))
        for run_id, (kind, packing, zero_stage) in PREFERENCE_RUNS.items()})
    return {run_id: base / run_id / kind for run_id, (kind, _, _) in PREFERENCE_RUNS.items()}


@pytest.mark.parametrize("run_id", list(PREFERENCE_RUNS))
def test_preference_trainers_train_an_moe_model(preference_runs, run_id):
    """Under ZeRO-3, DPO and KTO build their reference after the policy, both under zero.Init: the reference's
    first forward (the eval at step 0) runs; every trainer adds the load-balancing loss and logs the routing
    statistics."""
    rows = read_metrics(preference_runs[run_id])
    assert rows[0]["step"] == 0 and "eval_loss" in rows[0]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for row in train:
        assert row["aux_loss"] > 0 and 1.0 <= row["moe/load_max_over_mean"] <= 4.0  # 4 experts
        assert "moe/layer1/load_max_over_mean" in row and row["moe/router_entropy"] > 0


def test_async_moe_routes_drift_and_replay_runs(assets, tmp_path):
    """Asynchronous training samples with weights one update old: the trainer's router then picks other experts
    than the rollout's for some tokens (what moe/route_mismatch reports), and the update replays the rollout's."""
    overrides = _moe_overrides(assets, tmp_path, "qwen3_moe", "train.colocate_all=false", "train.async_train=true",
                               "actor.num_ranks=1", "rollout.num_engines=1", "algo.is_correction=tis",
                               "actor.learning_rate=1e-2", "train.max_steps=4", "algo.routing_replay=rollout")
    run_on_ranks(_fit, 2, overrides)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    _check_moe_rows(rows)
    assert rows[0]["moe/route_mismatch"] == 0.0  # the first batch was sampled with the trained weights
    assert max(r["moe/route_mismatch"] for r in rows[1:]) > 0.0


def test_multi_turn_agent_with_routing_replay(assets, tmp_path):
    """A multi-turn agent (the retry agent: wrong answers get feedback and another turn) on the MoE actor with
    routing replay: every turn's routes reach the update, whose routes then equal the rollout's."""
    agent = str(ROOT / "examples/agents/math_retry_agent.py")
    run_on_ranks(_fit, 2, _moe_overrides(assets, tmp_path, "qwen3_moe", "reward.reward_func_path=null",
                                         f"train.agent_func_path={agent}", "train.agent_max_turns=2",
                                         "train.max_steps=2", "algo.routing_replay=rollout"))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    _check_moe_rows(rows)
    assert any(r["agent/num_turns"] > 1 for r in rows)  # episodes took a second turn
    assert rows[0]["moe/route_mismatch"] == 0.0  # colocated on-policy: the trainer routes as the engine did
