"""A branching agent in AReaL's workflow shape: two first answers (one ``n=2`` call), each questioned again.

The trainer builds ``BranchingMathWorkflow(**train.agent_kwargs)`` once per rollout rank and awaits
``arun_episode(client, data)`` for every episode, with an ``openai.AsyncOpenAI`` client pointed at the rollout
engine's OpenAI-compatible endpoint::

    train.agent_func_path=examples/agents/openai_branching_agent.py   (pip install 'hpc-rlhf[agents]')

The episode's calls form two branches (choice 1 + its follow-up, choice 2 + its follow-up), so it trains as
two rows that share the episode's reward; GRPO still normalises over the ``n_samples_per_prompt`` episodes of
a prompt (docs/agents_openai.md, "Branching episodes"). Reward: the fraction of the two final answers that are
right, plus a small format term so a policy starting from random weights gets a signal on the tiny
arithmetic task. Messages use only characters the tiny char-level test tokenizer knows.
"""

FOLLOW_UP = "are you sure?"


def digit_fraction(text):
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


class BranchingMathWorkflow:
    def __init__(self, model="policy", max_tokens=None):
        self.model = model
        self.extra = {} if max_tokens is None else {"max_tokens": max_tokens}

    async def arun_episode(self, client, data):
        messages = data["messages"]
        first = await client.chat.completions.create(model=self.model, messages=messages, n=2, **self.extra)
        finals = []
        for choice in first.choices:  # continue both choices: two branches
            followed = messages + [{"role": "assistant", "content": choice.message.content or ""},
                                   {"role": "user", "content": FOLLOW_UP}]
            second = await client.chat.completions.create(model=self.model, messages=followed, **self.extra)
            finals.append((second.choices[0].message.content or "").strip())
        accuracy = sum(final == str(data["label"]) for final in finals) / len(finals)
        form = sum(digit_fraction(final) for final in finals) / len(finals)
        return {"reward": accuracy + 0.5 * form, "score": accuracy, "extra_logs": {"accuracy": accuracy}}
