"""An agent written against the OpenAI API, trained unchanged: answer, hear "are you sure?", answer again.

The trainer gives ``run_episode`` an ``openai.AsyncOpenAI`` client pointed at the rollout engine's
OpenAI-compatible endpoint (its API key is the episode id); every call is recorded token by token, and the
episode's chat becomes one training sequence with only the model's answers trained::

    train.agent_func_path=examples/agents/openai_math_agent.py   (pip install 'hpc-rlhf[agents]')

Reward: the final answer's correctness (exact match with the label), plus half a point for a first answer
that is already right, plus a small format term (the fraction of digits in the final answer) so that a
policy starting from random weights gets a signal on the tiny arithmetic task. Messages use only characters
the tiny char-level test tokenizer knows.
"""

FOLLOW_UP = "are you sure?"


def digit_fraction(text):
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


async def run_episode(client, prompt, label, model="policy", max_tokens=None):
    messages = [{"role": "user", "content": prompt}]
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    first = await client.chat.completions.create(model=model, messages=messages, **extra)
    answer = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    second = await client.chat.completions.create(model=model, messages=messages, **extra)
    final = (second.choices[0].message.content or "").strip()
    first_correct = float(answer.strip() == str(label))
    correct = float(final == str(label))
    return {"reward": correct + 0.5 * first_correct + 0.5 * digit_fraction(final), "score": correct,
            "extra_logs": {"accuracy": correct, "first_accuracy": first_correct}}
