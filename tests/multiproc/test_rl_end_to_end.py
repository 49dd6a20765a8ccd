"""Online RL on 2 and 4 gloo ranks with DeepSpeed roles, the transformers rollout engine and weight sync."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_each_on_ranks, run_on_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()


def test_grpo_colocated_reward_rises_and_export_loads(assets, tmp_path):
    run_on_ranks(_fit, 2, grpo_overrides(assets, tmp_path, "train.max_steps=30"))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.15, (first, last)
    for key in ("policy_loss", "actor_grad_norm", "response_length", "rollout_tokens_per_s", "timing/generation",
                "timing/make_experience", "timing/train", "timing/weight_sync", "timing/step"):
        assert key in rows[-1], key
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(assets["model"]).config.vocab_size
    assert (tmp_path / "config.resolved.yaml").is_file()
    _check_step_signals(rows, model.config.vocab_size, generate_max_len=4, source=Path(assets["data"]).stem)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_cispo_and_sapo_reward_rises(assets, tmp_path, loss_type):
    """Each of the two losses trains the tiny GRPO task with the reward rising, off-policy, and its weight acts.

    Two epochs over each step's rollouts (``train.max_epochs=2``): the second epoch's ratio to the rollout policy
    is not 1. On-policy (ratio exactly 1) PPO, CISPO and SAPO have the same gradient, so a run there cannot tell a
    wrong CISPO cap or SAPO gate (or a loss that ignores the old log-probs) from a right one."""
    band = ["algo.eps_clip_low=1.0", "algo.eps_clip_high=0.05"] if loss_type == "cispo" else []  # MiniMax-M1: no low
    run_on_ranks(_fit, 2, grpo_overrides(assets, tmp_path, "train.max_steps=30", f"algo.policy_loss_type={loss_type}",
                                         "train.max_epochs=2", *band))
    rows = read_metrics(tmp_path)
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.15, (first, last)
    # off-policy: the update moved the policy away from the one that sampled (the loss's ratio saw it)
    assert max(abs(r["ratio_mean"] - 1) for r in rows) > 1e-3, [r["ratio_mean"] for r in rows]
    if loss_type == "cispo":  # the cap bound some tokens' weights (their ratio rose past 1 + eps_clip_high)
        assert all(0 <= r["clip_fraction"] <= 1 for r in rows)
        assert max(r["clip_fraction"] for r in rows) > 0, [r["clip_fraction"] for r in rows]
    else:  # the gate faded some tokens' gradients (weight 4 s (1 - s) < 1 away from ratio 1)
        assert all(0 < r["gate_weight_mean"] <= 1 for r in rows)
        assert min(r["gate_weight_mean"] for r in rows) < 1 - 1e-4, [r["gate_weight_mean"] for r in rows]


def _check_step_signals(rows: list[dict], vocab_size: int, generate_max_len: int, source: str) -> None:
    """Entropy, length spread, clipping and per-source reward are in every step's row and make sense."""
    for row in rows:
        # A policy entropy, logged with algo.entropy_loss_coef=0: positive, at most that of a uniform policy.
        assert 0 < row["entropy"] <= math.log(vocab_size), (row["step"], row["entropy"])
        assert row["response_length/min"] <= row["response_length"] <= row["response_length/max"] <= generate_max_len
        # Single-turn: a row is truncated exactly when the engine stopped it at the token limit.
        assert 0 <= row["response_length/clip_fraction"] == row["truncated_fraction"] <= 1
        # One data source (the prompt file's stem): its reward is the overall reward.
        assert [k for k in row if k.startswith("reward/")] == [f"reward/{source}"], row["step"]
        assert row[f"reward/{source}"] == pytest.approx(row["reward"], abs=1e-6)
    # A 4-token budget clips some responses of the untrained model early in the run.
    assert any(row["response_length/clip_fraction"] > 0 for row in rows)


def _one_ppo_step(rank, world_size, overrides):
    trainer = run_trainer(rank, world_size, overrides)
    before = {name: t.clone() for b in trainer.roles.actor.gathered_state_dict_items() for name, t in b}
    critic_before = {name: t.clone() for b in trainer.roles.critic.gathered_state_dict_items() for name, t in b}
    trainer.fit()
    after = {name: t for b in trainer.roles.actor.gathered_state_dict_items() for name, t in b}
    critic_after = {name: t for b in trainer.roles.critic.gathered_state_dict_items() for name, t in b}
    trainable = {n for n, p in trainer.roles.actor.module.named_parameters() if p.requires_grad}
    unchanged = sorted(n for n in trainable if torch.equal(before[n], after[n]))
    critic_changed = sum(not torch.equal(critic_before[n], critic_after[n]) for n in critic_before)
    return {"unchanged": unchanged, "num_trainable": len(trainable), "critic_changed": critic_changed,
            "critic_total": len(critic_before)}


@pytest.fixture(scope="module")
def ppo_steps(assets, tmp_path_factory):
    """One PPO step under ZeRO-2 and one under ZeRO-3, in one spawn; ``{stage: (output folder, per-rank results)}``."""
    base = tmp_path_factory.mktemp("ppo")
    runs = run_each_on_ranks(_one_ppo_step, 2, {
        f"zero{stage}": (grpo_overrides(
            assets, base / f"zero{stage}", "algo.advantage_estimator=gae", "rollout.n_samples_per_prompt=1",
            "rollout.rollout_batch_size=16", "train.train_batch_size=16", "train.micro_train_batch_size=8",
            "algo.kl.init_coef=0.01", "train.max_steps=1", f"ds.zero_stage={stage}",
            "critic.learning_rate=1e-3", "critic.lr_warmup_ratio=0"),) for stage in (2, 3)})
    return {int(name[-1]): (base / name, results) for name, results in runs.items()}


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ppo_gae_updates_every_actor_parameter_and_the_critic(ppo_steps, zero_stage):
    out, results = ppo_steps[zero_stage]
    for r in results:
        assert r["num_trainable"] > 0
        assert r["unchanged"] == [], f"actor parameters did not change: {r['unchanged']}"
        assert r["critic_changed"] == r["critic_total"]
    row = read_metrics(out)[0]
    assert "critic_loss" in row and "kl" in row and row["kl_coef"] == pytest.approx(0.01)


def _disaggregated(rank, world_size, overrides):
    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams

    trainer = run_trainer(rank, world_size, overrides)
    assert trainer.world.placement.layout == "disaggregated"
    trainer.fit()
    out = {"roles": trainer.world.placement.roles_of(rank)}
    if trainer.roles.rollout is not None:
        engine = trainer.roles.rollout.engine
        prompt = trainer.tokenizer("3+4=")["input_ids"]
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        out["generated"] = engine.generate([GenerationRequest(prompt, greedy)])[0].output_ids
        out["weights"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
    return out


def test_disaggregated_4_ranks_syncs_weights_to_rollout(assets, tmp_path):
    overrides = grpo_overrides(
        assets, tmp_path, "train.colocate_all=false", "actor.num_ranks=2", "ref.num_ranks=1",
        "rollout.num_engines=1", "algo.kl.init_coef=0.01", "algo.kl.use_loss=true", "train.max_steps=3",
        "logger.logging_steps=2")
    results = run_on_ranks(_disaggregated, 4, overrides)
    assert [r["roles"] for r in results] == [["actor"], ["actor"], ["ref"], ["rollout"]]
    rollout = results[3]
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    initial = AutoModelForCausalLM.from_pretrained(assets["model"])
    trained_sd = trained.state_dict()
    for name, tensor in rollout["weights"].items():
        assert torch.allclose(tensor, trained_sd[name]), name
    assert any(not torch.equal(t, initial.state_dict()[n]) for n, t in rollout["weights"].items())
    # Generation after the sync follows the trained weights (greedy = the trained model's argmax).
    prompt = AutoTokenizer.from_pretrained(assets["model"])("3+4=")["input_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(6):
            nxt = trained(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if nxt.item() == trained.config.eos_token_id:
                break
    assert rollout["generated"] == ids[0, len(prompt):].tolist()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [2, 3]  # every logger.logging_steps-th step and the last
    assert "kl_loss" in rows[-1]


@pytest.mark.parametrize("ring_attn_size", [1, 2], ids=["unsplit", "ring2"])
def test_reward_model_role(assets, tmp_path, ring_attn_size):
    """ring2: the reward model (like the actor) scores each row split over 2 ranks with ring attention
    (its equivalence to the unsplit scores: tests/multiproc/test_sequence_parallel.py)."""
    from transformers import AutoModelForSequenceClassification

    rm_dir = tmp_path / "rm"
    rm = AutoModelForSequenceClassification.from_pretrained(assets["model"], num_labels=1)
    rm.config.pad_token_id = rm.config.eos_token_id
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(rm_dir)
    overrides = grpo_overrides(assets, tmp_path / "run", "reward.reward_func_path=null", f"reward.pretrain={rm_dir}",
                               "train.max_steps=2", f"ds.ring_attn_size={ring_attn_size}")
    run_on_ranks(_fit, 2, overrides)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    # Scores come from the model: real-valued, not the 0/1 of the arithmetic function.
    assert all(r["reward"] == r["score"] for r in rows)
    assert len({round(r["reward"], 6) for r in rows}) == 2


def test_raising_reward_function_fails_the_step_with_prompt_and_traceback(assets, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "def reward_func(queries, prompts, labels, **kw):\n"
        "    for p in prompts:\n"
        "        if p.startswith('7+'):\n"
        "            raise ZeroDivisionError('cannot score ' + p)\n"
        "    return {'rewards': [0.0] * len(queries)}\n")
    overrides = grpo_overrides(assets, tmp_path / "run", f"reward.reward_func_path={bad}", "train.max_steps=20")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hpc_rlhf.cli.train_ppo",
         *overrides], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    err = proc.stderr
    assert "ZeroDivisionError" in err and "cannot score 7+" in err
    assert "bad_reward.py" in err


KNOBS = {
    "reinforce": ["algo.advantage_estimator=reinforce", "algo.kl.init_coef=0.01", "algo.kl.estimator=k2"],
    "reinforce_baseline": ["algo.advantage_estimator=reinforce_baseline", "algo.is_correction=tis"],
    "rloo_gspo": ["algo.advantage_estimator=rloo", "algo.policy_loss_type=gspo",
                  "algo.loss_agg_mode=seq_mean_token_mean", "algo.eps_clip_low=3e-4", "algo.eps_clip_high=4e-4"],
    # The untrained tiny model solves nothing, so every group scores 0: the band keeps those groups (an
    # update must run for the knobs to be exercised); dropping groups is covered by the filtering tests.
    "dr_grpo_dapo": ["algo.advantage_estimator=dr_grpo", "algo.dynamic_filtering=true",
                     "algo.dynamic_filtering_reward_range=[-0.01,0.99]", "algo.overlong_buffer_len=2",
                     "algo.eps_clip_high=0.28", "algo.dual_clip=3", "algo.is_correction=icepop",
                     "algo.entropy_loss_coef=0.01"],
    "grpo_kl_loss_multi_epoch": ["algo.kl.init_coef=0.01", "algo.kl.use_loss=true", "algo.kl.estimator=k3",
                                 "train.max_epochs=2", "train.train_batch_size=32", "train.micro_train_batch_size=16"],
}


def _fit_counting_changed_actor_tensors(rank, world_size, overrides):
    trainer = run_trainer(rank, world_size, overrides)
    before = {name: t.clone() for b in trainer.roles.actor.gathered_state_dict_items() for name, t in b}
    trainer.fit()
    after = {name: t for b in trainer.roles.actor.gathered_state_dict_items() for name, t in b}
    return sum(not torch.equal(before[n], after[n]) for n in before)


@pytest.fixture(scope="module")
def knob_runs(assets, tmp_path_factory):
    """``{knob: (output folder, actor tensors changed per rank)}``: every knob's run in one spawn."""
    base = tmp_path_factory.mktemp("knobs")
    runs = run_each_on_ranks(_fit_counting_changed_actor_tensors, 2, {
        name: (grpo_overrides(assets, base / name, "train.max_steps=2", *knob),) for name, knob in KNOBS.items()})
    return {name: (base / name, changed) for name, changed in runs.items()}


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_algorithm_knobs_update_the_actor(knob_runs, name):
    out, changed = knob_runs[name]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    trained = [row for row in rows if row.get("skipped_update") != 1.0]
    # A knob that silently skips every update (or zeroes every gradient) must fail here.
    assert trained, "every update was skipped"
    for row in trained:
        assert 0 < row["actor_grad_norm"] < float("inf"), row["actor_grad_norm"]
    assert all(c > 0 for c in changed), f"actor tensors changed per rank: {changed}"
    if "is_correction=tis" in " ".join(KNOBS[name]):
        assert any(k.startswith("is/") for k in rows[-1])
    if "kl.use_loss=true" in " ".join(KNOBS[name]):
        assert "kl_loss" in rows[-1] and "kl" in rows[-1]


def _record_phases(rank, world_size, overrides, shares_actor):
    from hpc_rlhf.trainers.rl import setup as rl_setup

    if not shares_actor:  # a rollout engine with weights of its own, as vLLM's
        rl_setup.rollout_shares_actor = lambda cfg, world: False
    trainer = run_trainer(rank, world_size, overrides)
    assert trainer.roles.rollout.engine.shares_trained_model == shares_actor
    calls = []
    engine, actor = trainer.roles.rollout.engine, trainer.roles.actor
    for obj, name in ((engine, "wake_up"), (engine, "sleep"), (engine, "generate"), (engine, "update_weights"),
                      (actor, "reload_states"), (actor, "offload_states"), (actor, "backward")):
        original = getattr(obj, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            if _name == "wake_up":  # which parts wake matters: weights before the sync, the KV cache after it
                calls.append((_name, tuple(args[0]) if args and args[0] is not None else None))
            elif _name == "offload_states":
                calls.append((_name, kwargs.get("keep_weights", False)))
            else:
                calls.append((_name,))
            return _original(*args, **kwargs)
        setattr(obj, name, wrapper)
    trainer.fit()
    collapsed = [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]]
    return collapsed


@pytest.mark.parametrize("shares_actor", [False, True])
def test_colocated_step_time_shares_the_device(assets, tmp_path, shares_actor):
    """wake rollout -> generate -> sleep -> reload training states -> train -> offload grads and Adam states ->
    wake rollout weights -> sync -> offload actor weights -> wake the KV cache (weight_sync/colocated.py).
    A transformers rollout generating with the actor's own module (the default colocated on CPU) has nothing
    to sync: its weights are the actor's and stay where they are."""
    calls = run_on_ranks(_record_phases, 2, grpo_overrides(assets, tmp_path, "train.max_steps=1"),
                         shares_actor)[0]
    assert calls[:3] == [("wake_up", None), ("generate",), ("sleep",)], calls
    train = calls.index(("backward",))
    assert ("reload_states",) in calls[3:train], calls
    after_train = [c for c in calls[train:] if c != ("backward",)]
    if shares_actor:
        assert after_train == [("offload_states", True)], calls
    else:
        assert after_train == [("offload_states", True), ("wake_up", ("weights",)), ("update_weights",),
                               ("offload_states", False), ("wake_up", ("kv_cache",))], calls


def _first_step_of_runs(assets, tmp_path, common, runs) -> tuple[dict, dict]:
    """One 2-rank run per ``runs`` entry (extra overrides); its first metrics row and exported weights."""
    from safetensors.torch import load_file

    rows, weights = {}, {}
    for name, extra in runs.items():
        out = tmp_path / name
        run_on_ranks(_fit, 2, grpo_overrides(assets, out, *common, *extra))
        rows[name] = read_metrics(out)[0]
        weights[name] = load_file(out / "model" / "model.safetensors")
    return rows, weights


def test_packed_token_budgeted_batches_match_padded_fixed_ones(assets, tmp_path):
    """Same rollouts, one step: packing + token budgets (unequal micro-batch counts across the 2 ZeRO-3
    ranks, balanced shards) give the padded run's loss, gradient norm and updated weights."""
    common = ("train.max_steps=1", "ds.zero_stage=3", "train.num_episodes=1", "rollout.generate_max_len=6",
              "train.micro_train_batch_size=8", "rollout.micro_rollout_batch_size=8")
    runs = {
        "padded": (),
        "packed": ("train.packing_samples=true", "train.use_dynamic_batch=true", "train.max_tokens_per_gpu=60",
                   "rollout.max_tokens_per_gpu=90"),
    }
    rows, weights = _first_step_of_runs(assets, tmp_path, common, runs)
    for key in ("reward", "policy_loss", "actor_grad_norm", "entropy"):  # entropy: logged, outside the loss
        assert rows["packed"][key] == pytest.approx(rows["padded"][key], rel=1e-4, abs=1e-6), key
    assert weights["packed"].keys() == weights["padded"].keys()
    for name, tensor in weights["padded"].items():
        assert torch.allclose(weights["packed"][name], tensor, atol=1e-5), name


def test_ring_attention_sequence_parallel_step_matches_data_parallel(assets, tmp_path):
    """ds.ring_attn_size=2 on 2 ranks (one replica whose sequences are split over both ranks, ring
    attention over gloo) computes the same step as 2 data-parallel replicas: reward, KL to the
    reference, entropy bonus, loss, gradient norm and updated weights."""
    common = ("train.max_steps=1", "train.num_episodes=1", "rollout.generate_max_len=6", "algo.kl.init_coef=0.01",
              "algo.kl.use_loss=true", "algo.entropy_loss_coef=0.01", "train.micro_train_batch_size=16",
              "rollout.micro_rollout_batch_size=16")
    runs = {"dp": (), "sp": ("ds.ring_attn_size=2",),
            "sp_packed": ("ds.ring_attn_size=2", "train.packing_samples=true")}
    rows, weights = _first_step_of_runs(assets, tmp_path, common, runs)
    for name in ("sp", "sp_packed"):
        for key in ("reward", "kl", "policy_loss", "kl_loss", "actor_grad_norm", "entropy"):
            assert rows[name][key] == pytest.approx(rows["dp"][key], rel=1e-4, abs=1e-6), (name, key)
        for param, tensor in weights["dp"].items():
            # Adam's first step is lr * g / (|g| + eps), about lr * sign(g): where |g| is near eps (1e-8),
            # float noise in the reduction order moves a weight by up to ~lr (seen: 1 of 4096 elements off by
            # 1.1e-4). A wrong gradient direction moves a large share of them; its scale the grad norm checks.
            off = (weights[name][param] - tensor).abs() > 1e-4
            assert off.float().mean() < 1e-3, (name, param, int(off.sum()), off.numel())
