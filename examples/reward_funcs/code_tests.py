"""Unit-test reward for code: run the response's Python in the sandbox against the sample's tests.

Use with prompt rows whose label holds the tests (``hpc_rlhf.rewards.code`` lists the forms), e.g.
``{"input": "Write add(a, b) ...", "label": {"asserts": ["assert add(1, 2) == 3"]}}``, and
``data.label_key=label reward.reward_func_path=examples/reward_funcs/code_tests.py``.

The sandbox is chosen by environment variables read once, when the first batch arrives:

* ``HPC_RLHF_SANDBOX``: ``auto`` (default: bubblewrap, refusing to start without it), ``bwrap``, ``rlimits``
  (no isolation: trusted code only) or ``remote``;
* ``HPC_RLHF_SANDBOX_URL``: the SandboxFusion service for ``remote``;
* ``HPC_RLHF_SANDBOX_PYTHON``: the interpreter inside the sandbox (default ``/usr/bin/python3``; another one's
  install prefix is mounted read-only, e.g. a conda env with numpy);
* ``HPC_RLHF_CODE_REWARD``: ``fraction`` (default: the share of tests passed) or ``all_pass``;
* ``HPC_RLHF_CODE_TIME_LIMIT_S``: seconds per test (default 5).
"""

import os

from hpc_rlhf.rewards.code import make_code_reward_func
from hpc_rlhf.sandbox.factory import make_sandbox
from hpc_rlhf.sandbox.limits import SandboxLimits

_reward_func = None


def reward_func(queries, prompts, labels, responses=None):
    global _reward_func
    if _reward_func is None:
        mode = os.environ.get("HPC_RLHF_CODE_REWARD", "fraction")
        if mode not in ("fraction", "all_pass"):
            raise ValueError(f"HPC_RLHF_CODE_REWARD must be 'fraction' or 'all_pass', got {mode!r}")
        seconds = float(os.environ.get("HPC_RLHF_CODE_TIME_LIMIT_S", "5"))
        sandbox = make_sandbox(os.environ.get("HPC_RLHF_SANDBOX", "auto"), url=os.environ.get("HPC_RLHF_SANDBOX_URL"),
                               python=os.environ.get("HPC_RLHF_SANDBOX_PYTHON"),
                               limits=SandboxLimits(wall_time_s=seconds, cpu_time_s=max(1, round(seconds))))
        _reward_func = make_code_reward_func(sandbox, all_pass=mode == "all_pass", time_limit_s=seconds)
    return _reward_func(queries, prompts, labels, responses=responses)
