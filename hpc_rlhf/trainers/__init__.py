"""Training loops: online RL (PPO family) and, later, SFT / RM / DPO / KTO."""
