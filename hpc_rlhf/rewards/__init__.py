"""Rewards: user reward functions (OpenRLHF's file format), the remote reward-model client, and scoring
trajectories with either."""
