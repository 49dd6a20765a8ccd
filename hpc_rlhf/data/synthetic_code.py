"""A seeded code-writing task for the CPU code recipe: a one-line Python function from a description of its steps.

``"double inc neg"`` -> ``def f(x): x=x*2; x=x+1; x=-x; return x``. Eight steps (:data:`STEPS`) in sequences of
three give 512 functions. They are split once (a fixed seed, the same for every file) into three disjoint sets:
functions the SFT stage shows (``sft``), functions whose prompts GRPO trains on (``rl``) and functions only the
evaluation asks for (``heldout``). Every step appears in every position in SFT, but the held-out sequences never
do: held-out pass@1 measures programs neither stage has seen written, composed from parts SFT showed.

A prompt row's label holds its unit tests in the assert form of :mod:`hpc_rlhf.rewards.code`: ONE assert comparing
``f`` at several inputs, so a sample costs one sandbox execution (and passes all or nothing). Every character of
the prompts and programs is in the tiny char tokenizer's vocabulary.
"""

from __future__ import annotations

import itertools
import random
from typing import Literal

# step word -> the statement it becomes (each one a pure function of x, so a program is a fold over the steps)
STEPS = {"double": "x=x*2", "triple": "x=x*3", "inc": "x=x+1", "dec": "x=x-1", "neg": "x=-x", "square": "x=x*x",
         "half": "x=x//2", "addten": "x=x+10"}
NUM_STEPS = 3
TEST_INPUTS = (-3, 0, 1, 2, 5)
NUM_HELDOUT_FUNCTIONS = 128  # 128, not 64: greedy pass@1 moves in steps of 1/128
# more than GRPO can fit in the recipe's 30 steps (with 128 it fitted them and held-out pass@1 dipped); SFT keeps 128
NUM_RL_FUNCTIONS = 256
SPLIT_SEED = 1234  # fixed: every file of every run agrees on which functions are held out

Split = Literal["sft", "rl", "heldout"]
Function = tuple[str, ...]  # step words, in order


def split_functions(split: Split) -> list[Function]:
    """The functions of one split (disjoint from the other two; the same on every call)."""
    functions = list(itertools.product(STEPS, repeat=NUM_STEPS))
    random.Random(SPLIT_SEED).shuffle(functions)
    rl_end = NUM_HELDOUT_FUNCTIONS + NUM_RL_FUNCTIONS
    return {"heldout": functions[:NUM_HELDOUT_FUNCTIONS], "rl": functions[NUM_HELDOUT_FUNCTIONS:rl_end],
            "sft": functions[rl_end:]}[split]


def describe(function: Function) -> str:
    """The prompt: the step words and a newline, after which the model writes the program."""
    return " ".join(function) + "\n"


def program(function: Function) -> str:
    return "def f(x): " + "".join(f"{STEPS[step]}; " for step in function) + "return x"


def evaluate(function: Function, x: int) -> int:
    scope = {"x": x}
    for step in function:
        exec(STEPS[step], {}, scope)  # the statements above, nothing from outside
    return scope["x"]


def unit_tests(function: Function) -> dict[str, list[str]]:
    """The label of a prompt row: one assert over every test input (one execution per sample)."""
    calls = ", ".join(f"f({x})" for x in TEST_INPUTS)
    expected = ", ".join(str(evaluate(function, x)) for x in TEST_INPUTS)
    return {"asserts": [f"assert ({calls}) == ({expected})"]}


def code_prompt_rows(num_samples: int, seed: int, split: Split, each_once: bool = False) -> list[dict[str, object]]:
    """``{"input": "double inc neg\\n", "label": {"asserts": [...]}}`` rows drawn from ``split``. ``each_once`` (and
    always for the held-out split): the split's first functions in their fixed order, each once (an evaluation
    set of at most the split's size)."""
    functions = split_functions(split)
    if each_once or split == "heldout":
        chosen = functions[:num_samples]
    else:
        rng = random.Random(seed)
        chosen = [rng.choice(functions) for _ in range(num_samples)]
    return [{"input": describe(fn), "label": unit_tests(fn)} for fn in chosen]


def code_sft_rows(num_samples: int, seed: int, split: Split = "sft") -> list[dict[str, str]]:
    """``{"input": "double inc neg\\n", "output": "def f(x): x=x*2; x=x+1; x=-x; return x"}`` rows from ``split``."""
    functions = split_functions(split)
    rng = random.Random(seed)
    return [{"input": describe(fn), "output": program(fn)}
            for fn in (rng.choice(functions) for _ in range(num_samples))]
