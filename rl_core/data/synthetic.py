"""The synthetic demo tasks, rule-rewarded, that a tiny model learns on CPU in minutes (``data.synthetic.task``):

* ``addition``: add two small numbers, ``7+12=`` -> ``19``;
* ``calc``: multiply two 2-digit numbers, which the tiny model cannot do itself but can ask the calculator for
  (a multi-turn rollout with tools)::

      user "37*48="  ->  assistant "<call>37*48</call>"  ->  tool "1776"  ->  assistant "1776"

Rows are in verl's dataset format, so the demo exercises exactly the path a user's data takes::

    {"data_source": "ppoflow/addition", "prompt": [{"role": "user", "content": "7+12="}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "19"}, "extra_info": {"split": "train", "index": 0}}
"""

from __future__ import annotations

import random

DATA_SOURCE = "ppoflow/addition"
CALC_DATA_SOURCE = "ppoflow/calc"
TASKS = ("addition", "calc", "shapes")
CALL, END_CALL = "<call>", "</call>"  # the calc task's call markers: special tokens of its tiny tokenizer
CALC_OPERANDS = (10, 99)


def addition_rows(count: int, seed: int, max_operand: int = 20, split: str = "train") -> list[dict]:
    """``count`` random problems a + b with 0 <= a, b <= ``max_operand``, deterministic in ``seed``."""
    rng = random.Random(f"{split}-{seed}")
    rows = []
    for index in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def corpus(max_operand: int = 20) -> list[str]:
    """Every problem and answer of the task as text: what the tiny tokenizer is trained on."""
    return [f"{a}+{b}={a + b}" for a in range(max_operand + 1) for b in range(max_operand + 1)]


def calc_rows(count: int, seed: int, split: str = "train") -> list[dict]:
    """``count`` random products a * b with a, b in ``CALC_OPERANDS``, deterministic in ``seed``."""
    rng = random.Random(f"calc-{split}-{seed}")
    rows = []
    for index in range(count):
        a, b = rng.randint(*CALC_OPERANDS), rng.randint(*CALC_OPERANDS)
        rows.append(
            {
                "data_source": CALC_DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}*{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def calc_transcript(row: dict, use_tool: bool) -> list[dict[str, str]]:
    """The messages after a calc row's prompt: the call, the calculator's answer and the final answer, or the answer
    alone."""
    expression, answer = row["prompt"][0]["content"].removesuffix("="), row["reward_model"]["ground_truth"]
    if not use_tool:
        return [{"role": "assistant", "content": answer}]
    return [
        {"role": "assistant", "content": f"{CALL}{expression}{END_CALL}"},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


# ---------------------------------------------------------------------------------------------- the visual task
SHAPES_DATA_SOURCE = "ppoflow/shapes"
SHAPES_QUESTION = "Which colour is the largest shape?"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (225, 200, 30)}
SHAPES_IMAGE_SIZE = 48  # pixels, square; the tiny VLMs' patches are 8 pixels wide
SHAPES_PER_IMAGE = 3


def shapes_image(rng: random.Random) -> tuple[bytes, list[str]]:
    """A PNG of ``SHAPES_PER_IMAGE`` squares and discs of different colours on a grey ground, the largest at least
    twice the area of any other (drawn last, so nothing hides it), and the shapes' colours, the largest's last."""
    import io

    from PIL import Image, ImageDraw

    colours = rng.sample(sorted(COLOURS), SHAPES_PER_IMAGE)
    sides = sorted(rng.sample(range(6, 12), SHAPES_PER_IMAGE - 1)) + [rng.randint(18, 26)]
    image = Image.new("RGB", (SHAPES_IMAGE_SIZE, SHAPES_IMAGE_SIZE), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for colour, side in zip(colours, sides):
        x, y = rng.randint(0, SHAPES_IMAGE_SIZE - side), rng.randint(0, SHAPES_IMAGE_SIZE - side)
        box = (x, y, x + side - 1, y + side - 1)
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), colours


def shapes_rows(count: int, seed: int, split: str = "train") -> list[dict]:
    """``count`` generated images with the question which colour the largest shape has, in verl's multimodal format
    (an ``<image>`` placeholder in the prompt, the image's PNG bytes in the ``images`` column; ``extra_info.colours``:
    every shape's colour), deterministic in ``seed``."""
    rng = random.Random(f"shapes-{split}-{seed}")
    rows = []
    for index in range(count):
        png, colours = shapes_image(rng)
        rows.append(
            {
                "data_source": SHAPES_DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"<image>{SHAPES_QUESTION}"}],
                "images": [{"bytes": png}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": colours[-1]},
                "extra_info": {"split": split, "index": index, "colours": colours},
            }
        )
    return rows
