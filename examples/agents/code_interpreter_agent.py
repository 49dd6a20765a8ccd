"""An OpenRLHF-style multi-turn agent with a Python interpreter: the model runs code between turns.

Each turn, a fenced ```python block in the model's action is run in the sandbox (state kept across the
episode's turns) and its output comes back as ``<output>...</output>`` feedback, masked from the loss. A turn
with ``Answer: <value>`` ends the episode; the reward is 1.0 when the value equals the label::

    train.agent_func_path=examples/agents/code_interpreter_agent.py data.label_key=label

The sandbox is the run's (the ``sandbox`` config section: ``sandbox.isolation``, ``sandbox.url``, limits, workers;
see docs/rewards.md), shared by the episodes of the process. ``extra_logs`` carry the episode's
``code_interpreter_calls`` (logged as ``extra/code_interpreter_calls``) and the sandbox seconds (logged as
``timing/tools/code_interpreter``, summed over the step's episodes).
"""

import re

from hpc_rlhf.agents.code_interpreter import CodeInterpreter
from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
from hpc_rlhf.rewards.code import extract_code
from hpc_rlhf.sandbox.factory import run_sandbox, run_sandbox_config

_ANSWER = re.compile(r"Answer:\s*(.+)")


class AgentInstance(AgentInstanceBase):
    def __init__(self):
        self.interpreter = CodeInterpreter(run_sandbox(), time_limit_s=run_sandbox_config().wall_time_s)

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        action = states["action_text"]
        answer = _ANSWER.search(action)
        if answer is not None:
            correct = float(answer.group(1).strip() == str(states["label"]).strip())
            return {"rewards": correct, "environment_feedback": "", "done": True,
                    "extra_logs": self.interpreter.stats()}
        if "```" in action:
            output = await self.interpreter.arun(extract_code(action))
            feedback = f"\n<output>\n{output}\n</output>\n"
        else:
            feedback = "\nRun code in a ```python block, or give the result as 'Answer: <value>'.\n"
        return {"rewards": 0.0, "environment_feedback": feedback, "done": False,
                "extra_logs": self.interpreter.stats()}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
