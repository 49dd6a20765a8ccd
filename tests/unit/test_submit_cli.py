"""hpc-rlhf submit: flag resolution, the submitit parameters it would submit, the plan guard (no SLURM needed)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.cli import submit as submit_cli
from hpc_rlhf.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PPO_70B = str(ROOT / "configs/ppo_70b.yaml")


@pytest.mark.parametrize("text,minutes", [
    ("30", 30), ("00:30", 1), ("90:00", 90), ("04:00:00", 240), ("1-00", 1440), ("2-01:30", 2970),
    ("0-00:00:30", 1), ("48:00:00", 2880),
])
def test_parse_slurm_time(text, minutes):
    assert submit_cli.parse_slurm_time(text) == minutes


@pytest.mark.parametrize("bad", ["", "4h", "1:2:3:4", "0", "-1"])
def test_parse_slurm_time_rejects(bad):
    with pytest.raises(ValueError, match="--time"):
        submit_cli.parse_slurm_time(bad)


def _resolve(argv):
    args = submit_cli.build_parser().parse_args(argv)
    return submit_cli.resolve(args, load_config(args.config, args.overrides))


def test_recipe_slurm_section_is_the_default_and_flags_win(tmp_path):
    sub = _resolve(["--config", PPO_70B, "--chdir", str(tmp_path)])
    assert (sub.nodes, sub.gpus_per_node, sub.tasks_per_node, sub.time_min) == (8, 8, 8, 48 * 60)
    assert sub.requeue and sub.signal_grace_s == 2400 and sub.num_ranks == 64
    assert sub.folder == str(tmp_path / "runs/ppo_70b/submitit")
    sub = _resolve(["--config", PPO_70B, "--nodes", "2", "--time", "1:00:00", "--signal-grace", "120",
                    "--no-requeue", "--partition", "p", "--account", "a"])
    assert (sub.nodes, sub.time_min, sub.signal_grace_s, sub.requeue) == (2, 60, 120, False)
    params = sub.executor_parameters()
    assert params["partition"] == "p" and params["account"] == "a" and params["gpus_per_node"] == 8
    assert params["additional_parameters"]["signal"] == "USR1@120"
    assert params["additional_parameters"]["no-requeue"] is True
    assert "--kill-on-bad-exit=1" in params["srun_args"]


def test_cpu_job_takes_tasks_per_node_and_one_rank_per_gpu_is_enforced():
    sub = _resolve(["--config", PPO_70B, "--gpus-per-node", "0", "--tasks-per-node", "2", "--nodes", "1"])
    assert (sub.tasks_per_node, sub.gpus_per_node) == (2, 0)
    assert "gpus_per_node" not in sub.executor_parameters()  # no --gpus-per-node=0 on GRES-less clusters
    with pytest.raises(ValueError, match="one rank per GPU"):
        _resolve(["--config", PPO_70B, "--gpus-per-node", "8", "--tasks-per-node", "4"])


def _dry_run_parameters(out: str) -> dict:
    """The JSON block ``--dry-run`` prints after its header line."""
    return json.loads(out.split(submit_cli.DRY_RUN_PARAMETERS, 1)[1])


def test_dry_run_prints_the_submitit_parameters_and_task_command(capsys):
    submit_cli.main(["--config", PPO_70B, "--partition", "gpu", "--time", "48:00:00", "--exclusive",
                     "--dry-run", "algo.kl.init_coef=0.02"])
    out = capsys.readouterr().out
    params = _dry_run_parameters(out)
    assert (params["nodes"], params["ntasks_per_node"], params["gpus_per_node"]) == (8, 8, 8)
    assert (params["partition"], params["time"], params["exclusive"]) == ("gpu", 2880, True)
    # The trainer's USR1 replaces submitit's own --signal=USR2@<signal_delay_s>: additional_parameters
    # are written after (and so override) submitit's flags.
    assert params["additional_parameters"]["signal"] == "USR1@2400" and params["signal_delay_s"] == 2400
    assert params["additional_parameters"]["requeue"] is True
    assert "no-requeue" not in params["additional_parameters"]
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in params["setup"]
    assert "--kill-on-bad-exit=1" in params["srun_args"]
    assert f"python -m hpc_rlhf.cli.train_ppo --config {PPO_70B} algo.kl.init_coef=0.02" in out
    assert "dry run: nothing submitted" in out
    args = submit_cli.build_parser().parse_args(["--config", PPO_70B, "--partition", "gpu", "--time", "48:00:00",
                                                 "--exclusive", "algo.kl.init_coef=0.02"])
    assert params == submit_cli.resolve(args, load_config(PPO_70B, args.overrides)).executor_parameters()


def test_dry_run_without_requeue(capsys):
    submit_cli.main(["--config", PPO_70B, "--no-requeue", "--signal-grace", "120", "--dry-run"])
    extra = _dry_run_parameters(capsys.readouterr().out)["additional_parameters"]
    assert extra["no-requeue"] is True and "requeue" not in extra and extra["signal"] == "USR1@120"


def test_plan_rejection_exits_nonzero_with_reason(capsys):
    with pytest.raises(SystemExit) as exc:
        submit_cli.main(["--config", PPO_70B, "--nodes", "8", "--dry-run", "vllm.gpu_memory_utilization=0.95"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "nothing submitted" in err


def test_bad_override_and_unknown_entry_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        submit_cli.main(["--config", PPO_70B, "--dry-run", "train.no_such_key=1"])
    assert exc.value.code == 2 and "no_such_key" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        submit_cli.main(["--config", PPO_70B, "--dry-run", "--entry", "train_nope"])
    assert exc.value.code == 2  # argparse: not one of the entries


def test_missing_entry_module_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(submit_cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exc:
        submit_cli.main(["--config", PPO_70B, "--dry-run", "--entry", "train_dpo"])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_training_task_resumes_after_requeue_and_fails_on_nonzero_exit(monkeypatch):
    task = submit_cli.TrainingTask("train_ppo", "cfg.yaml", ["train.max_steps=2"])
    assert task.argv({}) == ["--config", "cfg.yaml", "train.max_steps=2"]
    assert task.argv({"SLURM_RESTART_COUNT": "1"}) == ["--config", "cfg.yaml", "ckpt.load=true", "train.max_steps=2"]

    calls = []

    class FakeEntry:
        @staticmethod
        def main(argv):
            calls.append(argv)
            raise SystemExit(3)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    monkeypatch.setattr(submit_cli.importlib, "import_module", lambda name: FakeEntry)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    try:
        with pytest.raises(RuntimeError, match="exited with status 3"):
            task()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    assert calls == [["--config", "cfg.yaml", "train.max_steps=2"]]


def test_early_preemption_requeues_from_rank_0_only(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(submit_cli, "requeue_slurm_job", lambda: calls.append(True) or True)
    monkeypatch.setenv("SLURM_PROCID", "1")
    submit_cli._early_preemption(signal.SIGUSR1, None)
    assert calls == []
    monkeypatch.setenv("SLURM_PROCID", "0")
    submit_cli._early_preemption(signal.SIGUSR1, None)
    assert calls == [True]
    assert "SIGUSR1 before training started" in capsys.readouterr().err


def test_module_entry_dry_run():
    out = subprocess.run([sys.executable, "-m", "hpc_rlhf.cli.submit", "--config", PPO_70B, "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert _dry_run_parameters(out.stdout)["ntasks_per_node"] == 8


def test_submit_module_does_not_import_torch():
    code = "import sys, hpc_rlhf.cli.submit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
