"""The step-time model (hpc_rlhf.planning.step_time): its pieces by hand, and its CPU calibration.

The calibration cases are the three CPU workloads of docs/step_time.md, with the phase times measured there
(metrics.jsonl ``timing/*``, medians): the prediction must be within +-35 % per phase.
"""

import json
from pathlib import Path

import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.planning.devices import DEVICES, get_device
from hpc_rlhf.planning.model_shape import ModelShape
from hpc_rlhf.planning.step_time import (
    checkpoint_bytes_per_role,
    decode_bytes_per_step,
    forward_flops,
    kv_bytes_per_token,
    rl_step_time,
    training_flops,
    weight_sync_bytes,
    zero3_traffic_bytes,
)
from hpc_rlhf.planning.time_budget import (
    GraceTooShort,
    SlurmBudget,
    grace_check,
    read_sbatch_budget,
)
from hpc_rlhf.world.placement import build_placement

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_70B = ModelShape(8192, 80, 28672, 128256, 64, 8, 128)


def test_kv_cache_and_decode_bytes_by_hand():
    # Llama-3-70B in bf16: 80 layers x (K + V) x 8 KV heads x 128 dims x 2 bytes = 327,680 bytes per token
    assert kv_bytes_per_token(LLAMA3_70B, 2) == 80 * 2 * 8 * 128 * 2 == 327_680
    # one engine of TP 8 reading 141.2 GB of weights and 96 sequences x 1536 tokens of cache per decode step
    per_gpu = decode_bytes_per_step(141.2e9, 327_680, batch=96, context=1536, tp=8)
    assert per_gpu == pytest.approx((141.2e9 + 96 * 1536 * 327_680) / 8)
    assert per_gpu / 1e9 == pytest.approx(23.69, abs=0.01)


def test_forward_and_training_flops_by_hand():
    shape = ModelShape(576, 30, 1536, 49152, 9, 3, 64, tie_word_embeddings=True)
    n = shape.num_params  # 134.5M, of which 28.3M the tied embedding / head
    assert n == pytest.approx(134.5e6, rel=1e-3)
    body = n - 49152 * 576
    # 16 rows of 46 tokens, logits on the 16 x 32 response tokens
    fwd = forward_flops(shape, n, tokens=736, logit_tokens=512)
    assert fwd == pytest.approx(2 * body * 736 + 2 * 49152 * 576 * 512)
    assert training_flops(shape, n, 736, 512, gradient_checkpointing=False) == pytest.approx(3 * fwd)
    assert training_flops(shape, n, 736, 512, gradient_checkpointing=True) == pytest.approx(4 * fwd)


def test_sync_checkpoint_and_zero3_bytes_by_hand():
    assert weight_sync_bytes(70.6e9, 2) == pytest.approx(141.2e9)
    # bf16 weights + fp32 master + two fp32 moments = 14 bytes per trained parameter
    assert checkpoint_bytes_per_role(70.6e9, 0.0, 2) == pytest.approx(70.6e9 * 14)
    # fp32: no master copy; LoRA: the frozen base is saved in its dtype only
    assert checkpoint_bytes_per_role(1e6, 0.0, 4) == pytest.approx(12e6)
    assert checkpoint_bytes_per_role(1e6, 9e6, 2) == pytest.approx(10e6 * 2 + 1e6 * 12)
    # ZeRO-3 over 64 ranks, 3 passes of 2.2 GB shards' worth of weights + the gradients' reduce-scatter
    w = 141.2e9
    assert zero3_traffic_bytes(w, 64, 3, grad_bytes=w) == pytest.approx(w * 63 / 64 * 4)
    assert zero3_traffic_bytes(w, 1, 3) == 0.0


def test_every_number_of_every_device_has_a_source():
    for device in DEVICES.values():
        for name in ("peak_flops", "memory_bw", "intra_node_bw", "inter_node_bw", "host_link_bw", "mfu",
                     "decode_efficiency", "fs_bw", "layer_overhead_s", "step_overhead_s"):
            assert device.sources.get(name), f"{device.name}: {name} has no source"
        if device.gpu:
            assert "assum" in device.name  # nothing here ran on a GPU
    assert get_device("h100", fs_gbps=20).fs_bw == 20e9
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu")


def test_sbatch_budget_and_grace_check(tmp_path):
    budget = read_sbatch_budget(str(ROOT / "slurm/ppo_70b.sbatch"))
    assert budget.time_s == 48 * 3600 and budget.grace_s == 2400
    f = tmp_path / "x.sbatch"
    f.write_text("#!/bin/bash\n#SBATCH -t 1-02:00:00\n#SBATCH --signal=B:USR1\n")
    assert read_sbatch_budget(str(f)) == SlurmBudget(26 * 3600, 60, "--signal in x.sbatch")  # SLURM's default 60 s
    cfg = load_config(str(ROOT / "configs/ppo_70b.yaml"), [])
    step = rl_step_time(cfg, build_placement(cfg, 64), get_device("h100"), nodes=8, gpus_per_node=8)
    grace_check(step, SlurmBudget(None, 2400, "test"))
    with pytest.raises(GraceTooShort, match=r"1200 s before the time limit \(test\).*one step \(\d+ s\).*save \(\d+ s\)"):
        grace_check(step, SlurmBudget(None, 1200, "test"))


def _shape_dir(tmp_path: Path, name: str, **sizes) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(sizes))
    return folder


def _tiny_recipe(tmp_path):
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 83, "tie_word_embeddings": True}
    return _shape_dir(tmp_path, "tiny", **sizes), [], 2


def _tiny_benchmark(tmp_path):
    sizes = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "vocab_size": 83, "tie_word_embeddings": True}
    overrides = ["rollout.n_samples_per_prompt=8", "rollout.rollout_batch_size=16", "rollout.generate_max_len=16",
                 "rollout.micro_rollout_batch_size=32", "train.train_batch_size=128", "train.micro_train_batch_size=32",
                 "data.prompt_max_len=6"]
    return _shape_dir(tmp_path, "bench", **sizes), overrides, 1


def _smollm2(tmp_path):
    sizes = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    overrides = ["rollout.n_samples_per_prompt=4", "rollout.rollout_batch_size=4", "rollout.generate_max_len=32",
                 "rollout.micro_rollout_batch_size=16", "train.train_batch_size=16", "train.micro_train_batch_size=16",
                 "data.prompt_max_len=14", "algo.kl.init_coef=0.04", "algo.kl.use_loss=true", "algo.kl.estimator=k3"]
    return _shape_dir(tmp_path, "smollm2", **sizes), overrides, 1


# Measured on the 2-core CPU (docs/step_time.md): phase -> seconds, medians of metrics.jsonl timing/*.
CALIBRATION = {
    "grpo_tiny_cpu, 2 ranks": (_tiny_recipe, {"generation": 0.0097, "train actor": 0.0186}),
    "3.2M benchmark shape, 1 rank": (_tiny_benchmark, {"generation": 0.11, "train actor": 0.41}),
    "SmolLM2-135M shape, 1 rank": (_smollm2, {"generation": 2.29, "ref logprob": 0.87, "train actor": 2.85}),
}


def predicted_cpu_phases(case: str, tmp_path: Path) -> dict[str, float]:
    build, overrides, ranks = CALIBRATION[case][0](tmp_path)
    cfg = load_config(str(ROOT / "configs/grpo_tiny_cpu.yaml"),
                      [f"actor.pretrain={build}", "actor.build_tiny=false", *overrides])
    step = rl_step_time(cfg, build_placement(cfg, ranks), get_device("cpu"), nodes=1, gpus_per_node=ranks)
    return {p.name: p.seconds for p in step.phases}


@pytest.mark.parametrize("case", list(CALIBRATION))
def test_cpu_calibration_within_35_percent(case, tmp_path):
    predicted = predicted_cpu_phases(case, tmp_path)
    for phase, measured in CALIBRATION[case][1].items():
        ratio = predicted[phase] / measured
        assert 0.65 <= ratio <= 1.35, f"{case}: {phase} predicted {predicted[phase]:.4f} s, measured {measured} s"


def test_plan_prints_phases_and_fails_a_short_grace(capsys):
    from hpc_rlhf.cli.plan import plan

    base = ["--config", str(ROOT / "configs/ppo_70b.yaml"), "--nodes", "8", "--gpus-per-node", "8"]
    assert plan(base) == 0
    out = capsys.readouterr().out
    for line in ("generation", "ref logprob", "train actor", "train critic", "weight sync", "checkpoint:",
                 "steps per job", "signal grace 2400 s (slurm.signal_grace_s)"):
        assert line in out, line
    assert plan([*base, "--signal-grace-s", "1200"]) == 1
    err = capsys.readouterr().err
    assert "1200 s before the time limit (--signal-grace-s)" in err and "one step (" in err and "save (" in err
    # a faster filesystem shortens the save enough for the old grace
    assert plan([*base, "--signal-grace-s", "1200", "--fs-gbps", "20"]) == 0


def _phase(name: str, seconds: float):
    from hpc_rlhf.planning.step_time import Phase

    return Phase(name, seconds, "")


def test_forwards_on_disjoint_ranks_cost_the_busiest_rank():
    from hpc_rlhf.planning.step_time import forwards_overlap

    phases = [_phase("generation", 9.0), _phase("old logprob", 1.0), _phase("ref logprob", 3.0),
              _phase("values", 2.0), _phase("reward model", 5.0)]
    # actor, reference and critic each on ranks of their own: the phase costs the slowest forward
    apart = forwards_overlap(phases, {"actor": (0, 1), "ref": (2,), "critic": (3,), "reward": (4,)})
    assert apart is not None and apart.seconds == pytest.approx(6.0 - 3.0)
    # the reference shares the actor's ranks: those ranks run 1 + 3 s, the critic's 2 s at the same time
    shared = forwards_overlap(phases, {"actor": (0, 1), "ref": (0, 1), "critic": (3,), "reward": (4,)})
    assert shared is not None and shared.seconds == pytest.approx(6.0 - 4.0)
    # every role on every rank (colocated): nothing runs at once; the reward model is never counted
    assert forwards_overlap(phases, {"actor": (0, 1), "ref": (0, 1), "critic": (0, 1), "reward": (2,)}) is None
    # the critic's and the actor's updates on disjoint ranks count once more
    trained = [*phases, _phase("train critic", 4.0), _phase("train actor", 7.0)]
    both = forwards_overlap(trained, {"actor": (0, 1), "ref": (2,), "critic": (3,), "reward": (4,)})
    assert both is not None and both.seconds == pytest.approx((6.0 - 3.0) + (11.0 - 7.0))


def test_disaggregated_step_is_shorter_than_the_sum_of_its_phases():
    overrides = ["train.colocate_all=false", "actor.num_ranks=8", "ref.num_ranks=8", "critic.num_ranks=8",
                 "rollout.num_engines=8", "algo.advantage_estimator=gae", "algo.kl.init_coef=0.01",
                 "actor.num_params_b=7", "critic.num_params_b=7", "ref.num_params_b=7"]
    cfg = load_config(None, overrides)
    placement = build_placement(cfg, 32)
    step = rl_step_time(cfg, placement, get_device("h100"), nodes=4, gpus_per_node=8)
    phases = {p.name: p.seconds for p in step.phases}
    forwards = [phases[name] for name in ("old logprob", "ref logprob", "values")]
    updates = [phases[name] for name in ("train critic", "train actor")]
    assert step.overlap_s == pytest.approx(sum(forwards) - max(forwards) + sum(updates) - max(updates))
    assert step.step_s == pytest.approx(sum(phases.values()) - step.overlap_s)
