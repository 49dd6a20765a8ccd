"""``hpc-rlhf <command>``: one console script; each command lives in its own module."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "plan": ("hpc_rlhf.cli.plan", "placement and per-GPU memory of a recipe, without loading a model"),
    "train-ppo": ("hpc_rlhf.cli.train_ppo", "online RL: PPO, REINFORCE++, GRPO, RLOO (run under torchrun/srun)"),
    "train-sft": ("hpc_rlhf.cli.train_sft", "supervised fine-tuning"),
    "train-rm": ("hpc_rlhf.cli.train_rm", "reward model on preference pairs"),
    "train-dpo": ("hpc_rlhf.cli.train_dpo", "DPO / IPO / cDPO"),
    "train-kto": ("hpc_rlhf.cli.train_kto", "KTO"),
    "submit": ("hpc_rlhf.cli.submit", "submit a run to SLURM with submitit (plan check first)"),
    "quickstart": ("hpc_rlhf.cli.quickstart", "SFT then GRPO on this CPU in minutes, no downloads"),
    "export": ("hpc_rlhf.cli.export", "HF model from a run's last checkpoint (e.g. an interrupted run)"),
    "lora-merge": ("hpc_rlhf.cli.lora_merge", "merge a LoRA adapter into its base model (HF folder)"),
    "serve-rm": ("hpc_rlhf.cli.serve_rm", "serve a reward model over HTTP (OpenRLHF /get_reward)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: hpc-rlhf <command> [args]\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nhpc-rlhf: unknown command {argv[0]!r}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
