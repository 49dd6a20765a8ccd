"""Rewards: user reward functions (OpenRLHF's file format), the remote reward-model client, the reward-model role
(a frozen scorer on the ranks that host ``reward``), and scoring trajectories with a function or a client."""
