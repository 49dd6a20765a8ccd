"""Training loops: online RL in ``rl``, offline SFT / RM / DPO / KTO in ``offline``."""
