"""An OpenAI-client agent whose episodes have one or two branches: the first call asks for n=1 or n=2 answers
(at random), and every answer is questioned once more. Reward: the final answers' mean digit fraction."""

import random


async def run_episode(client, prompt, label):
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, n=random.choice([1, 2]))
    finals = []
    for choice in first.choices:
        followed = messages + [{"role": "assistant", "content": choice.message.content or ""},
                               {"role": "user", "content": "are you sure?"}]
        second = await client.chat.completions.create(model="policy", messages=followed)
        text = (second.choices[0].message.content or "").strip()
        finals.append(sum(ch.isdigit() for ch in text) / max(len(text), 1))
    return sum(finals) / len(finals)
