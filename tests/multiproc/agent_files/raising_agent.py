"""An agent whose step always raises: the run must stop at the failure limit."""

from hpc_rlhf.agents.multi_turn import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        raise KeyError("tool_result")
