"""Multi-turn agent whose environment answers with a screenshot: turn 1 asks to look, the environment shows an
image (a square of the label's colour, drawn with PIL), turn 2 names its colour by its initial (r, g, b, y).

The prompt text can be the same in every row (e.g. ``look``): only the screenshot tells the answer, so a policy
that learns this reads the image it got as feedback. Needs a vision-language actor (``docs/vlm.md``, "Agents with
images"); prompt rows like ``{"messages": "look", "label": "b"}``::

    train.agent_func_path=examples/agents/screenshot_colour_agent.py train.agent_max_turns=2

``environment_images`` takes PIL images, paths or base64 data URLs; the feedback text places each image with the
model's placeholder, written here as Qwen-VL's chat template writes one image. Its user-turn markers are those of
the tiny test model's template (``Q: ... \\nA: ``); with a real chat model, write the template's own turn markers.
"""

import random

from PIL import Image, ImageDraw

from hpc_rlhf.agents.multi_turn import AgentInstanceBase

COLOURS = {"r": (220, 30, 30), "g": (30, 180, 40), "b": (30, 60, 220), "y": (230, 210, 20)}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
FEEDBACK = "\nQ: " + IMAGE + "colour?\nA: "


def screenshot(colour, rng, side=56):
    """A ``side`` x ``side`` grey image with a square of ``colour`` (size and place drawn from ``rng``)."""
    grey = rng.randint(90, 170)
    image = Image.new("RGB", (side, side), (grey, grey, grey))
    size = rng.randint(side // 2, side - 8)
    x, y = rng.randint(0, side - size), rng.randint(0, side - size)
    ImageDraw.Draw(image).rectangle([x, y, x + size - 1, y + size - 1], fill=COLOURS[colour])
    return image


class AgentInstance(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        self.turn = 0
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        label = str(states["label"])
        if self.turn == 1:  # whatever the policy said, the environment shows the screen
            rng = random.Random(states["observation_text"] + states["action_text"] + label)
            return {"rewards": 0.0, "done": False, "environment_feedback": FEEDBACK,
                    "environment_images": [screenshot(label, rng)]}
        correct = float(states["action_text"].strip()[:1] == label)
        return {"rewards": correct, "scores": correct, "done": True, "extra_logs": {"accuracy": correct}}
