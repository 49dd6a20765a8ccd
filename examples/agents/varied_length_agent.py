"""Multi-turn agent whose episodes last 1 to ``max_turns`` turns, set by the prompt: for asynchronous agent RL
(in-flight weight updates, ``train.partial_rollout``) and its benchmark, where long episodes would otherwise keep
the engine waiting on a batch's tail.

An episode of the prompt ``a+b=`` lasts ``1 + (a + b) % max_turns`` turns (``max_turns`` from
``train.agent_kwargs``, default 3; ``step_latency_s`` adds an environment's own time per turn). Every turn is
scored like ``examples/reward_funcs/arithmetic_shaped.py`` (1.0 for exactly the answer, plus 0.5 x the fraction
of digit characters, so a policy from random weights gets a signal); the episode's reward is the mean over its
turns. Between turns the environment says ``"\\nA: "``, which
the tiny char-level test tokenizer knows.

    train.agent_func_path=examples/agents/varied_length_agent.py train.agent_kwargs='{max_turns: 10}'
"""

import asyncio
import re

from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor

FEEDBACK = "\nA: "
_INTEGER = re.compile(r"-?\d+")


def episode_turns(prompt: str, max_turns: int) -> int:
    """1 + (sum of the prompt's integers) % max_turns."""
    return 1 + sum(int(x) for x in _INTEGER.findall(prompt)) % max_turns


def turn_score(action: str, label) -> float:
    text = action.strip()
    digits = sum(ch.isdigit() for ch in action) / max(len(action), 1)
    return float(text == str(label)) + 0.5 * digits


class AgentInstance(AgentInstanceBase):
    def __init__(self, max_turns: int = 3, step_latency_s: float = 0.0, **kwargs):
        self.max_turns, self.step_latency_s = max_turns, step_latency_s
        self.turns = 1
        self.scores = []

    async def reset(self, states, **kwargs):
        self.turns = episode_turns(states["observation"], self.max_turns)
        self.scores = []
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        if self.step_latency_s:  # an environment's own time per turn (a tool call, a sandbox)
            await asyncio.sleep(self.step_latency_s)
        self.scores.append(turn_score(states["action_text"], states["label"]))
        done = len(self.scores) >= self.turns
        reward = sum(self.scores) / len(self.scores)
        return {"rewards": reward, "scores": reward, "environment_feedback": "" if done else FEEDBACK, "done": done,
                "extra_logs": {"planned_turns": float(self.turns)}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
