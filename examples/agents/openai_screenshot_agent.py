"""An OpenAI-client agent that shows the policy a screenshot: one chat call whose user message holds a base64 PNG
(a square of the label's colour, drawn with PIL) and asks for its colour; reward 1 when the reply starts with the
colour's initial (r, g, b, y). Needs a vision-language actor; the endpoint takes image content parts as OpenAI's
API does (``docs/agents_openai.md``)::

    train.agent_func_path=examples/agents/openai_screenshot_agent.py
"""

import base64
import io
import random

from PIL import Image, ImageDraw

COLOURS = {"r": (220, 30, 30), "g": (30, 180, 40), "b": (30, 60, 220), "y": (230, 210, 20)}


def screenshot_url(colour, rng, side=56):
    """A base64 PNG data URL: a grey ``side`` x ``side`` image with a square of ``colour``."""
    grey = rng.randint(90, 170)
    image = Image.new("RGB", (side, side), (grey, grey, grey))
    size = rng.randint(side // 2, side - 8)
    x, y = rng.randint(0, side - size), rng.randint(0, side - size)
    ImageDraw.Draw(image).rectangle([x, y, x + size - 1, y + size - 1], fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def run_episode(client, prompt, label, max_tokens=1):
    label = str(label)
    url = screenshot_url(label, random.Random())
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "colour?"}]}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
    correct = float((reply.choices[0].message.content or "").strip()[:1] == label)
    return {"reward": correct, "score": correct, "extra_logs": {"accuracy": correct}}
