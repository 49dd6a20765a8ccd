"""Offline trainers (SFT, reward model, DPO, KTO) on one shared data-parallel loop (``base``)."""
