"""Multi-turn math agent: answer, hear "wrong", retry (the multi-attempt task of AReaL's example).

The environment checks the last integer of each answer against the label. A wrong answer gets a
short feedback line and another attempt, up to ``MAX_ATTEMPTS``; a right one ends the episode with
reward ``TURN_DISCOUNT ** (attempt - 1)`` (so a first-try answer is worth most); running out of
attempts gives 0. ``scores`` is plain correctness (for dynamic filtering and logs).

Use with prompt rows like ``{"input": "What is 12 + 7?", "label": 19}``::

    train.agent_func_path=examples/agents/math_retry_agent.py data.label_key=label

The feedback uses only characters the tiny char-level test tokenizer knows and stays short. With a
chat model, write the feedback in the chat template's form (end of assistant turn, a user turn, the
generation prompt), e.g. for Qwen: ``"<|im_end|>\\n<|im_start|>user\\nWrong. Try again.<|im_end|>\\n"
"<|im_start|>assistant\\n"``.
"""

import re

from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor

MAX_ATTEMPTS = 3
TURN_DISCOUNT = 0.5
FEEDBACK = "\nWrong. Try again.\nA: "
_INTEGER = re.compile(r"-?\d+")


def last_integer(text):
    """The last integer in ``text`` (thousands separators removed), or None."""
    matches = _INTEGER.findall(str(text).replace(",", ""))
    return int(matches[-1]) if matches else None


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.attempt = 0

    async def reset(self, states, **kwargs):
        self.attempt = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.attempt += 1
        answer = last_integer(states["action_text"])
        expected = last_integer(states["label"])  # "19", 19 and GSM8K's "... #### 19" all work
        correct = answer is not None and answer == expected
        done = correct or self.attempt >= MAX_ATTEMPTS
        reward = TURN_DISCOUNT ** (self.attempt - 1) if correct else 0.0
        return {
            "rewards": reward,
            "scores": float(correct),
            "environment_feedback": "" if done else FEEDBACK,
            "done": done,
            "extra_logs": {"correct": float(correct), "attempts": float(self.attempt),
                           "has_answer": float(answer is not None)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
