"""OpenRLHF's AgentExecutorBase shape, unchanged: its original `openrlhf.utils.agent` import (aliased while the file
loads when openrlhf is not installed), agent kwargs and an execute override."""

import torch
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, bonus=0.0, **kwargs):
        self.bonus = bonus
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= 2
        # Long feedback: with a small data.max_len some episodes cannot fit it and are cut.
        return {"rewards": torch.tensor([float(len(states["action_text"]) % 2)]),
                "environment_feedback": "" if done else "\nNo. Think again, then answer.\nA: ",
                "done": done, "sampling_params": states.get("sampling_params"),
                "extra_logs": {"bonus_seen": self.bonus}}


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

    async def execute(self, prompt, label, sampling_params):
        out = await super().execute(prompt, label, sampling_params)
        out["extra_logs"]["wrapped_by_execute"] = 1.0
        return out
