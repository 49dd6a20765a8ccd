"""A seeded visual task drawn with PIL, written as a prompt file with images beside it (CPU recipes, tests).

``colour``: a square of one of four colours (its size, position and the grey of the background vary) and the
question ``colour?``; the answer is the colour's initial (``r``, ``g``, ``b``, ``y``). The text is the same in every
row, so only the image tells the answer: a model that learns the task reads its image.
"""

from __future__ import annotations

import random
from pathlib import Path

COLOURS = {"r": (220, 30, 30), "g": (30, 180, 40), "b": (30, 60, 220), "y": (230, 210, 20)}
QUESTION = "colour?"


def colour_rows(num_samples: int, seed: int, image_dir: Path, side: int = 56) -> list[dict]:
    """Draw ``num_samples`` images into ``image_dir`` and return their prompt rows (image paths relative to the
    folder of the prompt file, which is ``image_dir``'s parent)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(num_samples):
        label = rng.choice(sorted(COLOURS))
        grey = rng.randint(90, 170)
        image = Image.new("RGB", (side, side), (grey, grey, grey))
        size = rng.randint(side // 2, side - 8)
        x, y = rng.randint(0, side - size), rng.randint(0, side - size)
        ImageDraw.Draw(image).rectangle([x, y, x + size - 1, y + size - 1], fill=COLOURS[label])
        name = f"{i:05d}.png"
        image.save(image_dir / name)
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                     "images": [f"{image_dir.name}/{name}"], "label": label})
    return rows


def colour_task_rows(path: str | Path, num_samples: int, seed: int) -> list[dict]:
    """Rows of the ``colour`` task for the prompt file ``path`` (images in ``<stem>_images/`` beside it)."""
    path = Path(path)
    return colour_rows(num_samples, seed, path.parent / f"{path.stem}_images")


def colour_sft_rows(path: str | Path, num_samples: int, seed: int) -> list[dict]:
    """SFT rows of the ``colour`` task (``data.synthetic_task: sft_colour``): the prompt rows of
    :func:`colour_task_rows` with the answer (the colour's initial) as the assistant's turn."""
    rows = colour_task_rows(path, num_samples, seed)
    for row in rows:
        row["messages"].append({"role": "assistant", "content": row["label"]})
    return rows
