"""Hangs in two ways the step timeout must cut: a plain `def reset` that never returns (odd labels) and an
`async def step` that blocks its event loop with time.sleep (even labels)."""

import threading
import time

from hpc_rlhf.agents.multi_turn import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def reset(self, states, **kwargs):
        if int(states["label"]) % 2:
            threading.Event().wait()  # never set
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        time.sleep(3600)  # blocking call inside async def
        return {"rewards": 0.0, "done": True}
