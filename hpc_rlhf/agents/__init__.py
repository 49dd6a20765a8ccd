"""Agent execution and rewards.

* ``executor``: ``Trajectory``, ``AgentExecutor`` (the interface every rollout goes through),
  ``SingleTurnExecutor``.
* ``rewards``: user reward files in OpenRLHF's format (``RewardFunction``, ``RewardOutput``,
  ``RewardFunctionError``).
* ``scoring``: ``score_trajectories`` (decode, call the reward function, attach rewards).

Import the submodules directly; this package imports nothing so that loading one part never pulls
in the others.
"""
