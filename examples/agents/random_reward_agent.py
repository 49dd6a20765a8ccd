"""A minimal multi-turn agent in OpenRLHF's format: random rewards, a random number of turns.

Useful to check the plumbing (multi-turn rollout, feedback masking, rewards from the environment)
before writing a real environment::

    train.agent_func_path=examples/agents/random_reward_agent.py

It returns its reward as a tensor and hands the sampling parameters back unchanged, as OpenRLHF's
example does; both are accepted.
"""

import random

import torch

from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.rng = random.Random()
        self.turn = 0
        self.num_turns = self.rng.randint(1, 3)

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= self.num_turns
        reward = torch.tensor([float(self.rng.random() < 0.5)])
        feedback = "" if done else "\nOK. Go on.\nA: "
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"random_reward": reward},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    pass
