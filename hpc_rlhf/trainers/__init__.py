"""Training loops: online RL in ``rl``, offline SFT / RM / DPO / KTO in ``offline``; both run their steps in the
shared ``run_skeleton`` (resume, evals, metrics, stall guard, preemption, checkpoints, export)."""
