"""Unit-test reward for code: run the response's Python in the sandbox against the sample's tests.

Use with prompt rows whose label holds the tests (``hpc_rlhf.rewards.code`` lists the forms), e.g.
``{"input": "Write add(a, b) ...", "label": {"asserts": ["assert add(1, 2) == 3"]}}``, and
``data.label_key=label reward.reward_func_path=examples/reward_funcs/code_tests.py``.

The sandbox is the run's (the ``sandbox`` config section, built once per process on the first batch):
``sandbox.isolation`` (``auto``: bubblewrap, refusing to start without it; ``bwrap``; ``rlimits``: no isolation,
trusted code only; ``remote`` with ``sandbox.url``), ``sandbox.wall_time_s`` and the other limits per test,
``sandbox.max_workers``, ``sandbox.python``, and ``sandbox.code_reward`` (``fraction`` of the tests passed, or
``all_pass``).
"""

from hpc_rlhf.rewards.code import run_code_reward_func

_reward_func = None


def reward_func(queries, prompts, labels, responses=None):
    global _reward_func
    if _reward_func is None:
        _reward_func = run_code_reward_func()
    return _reward_func(queries, prompts, labels, responses=responses)
