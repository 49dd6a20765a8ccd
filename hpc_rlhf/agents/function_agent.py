"""OpenRLHF's older function-style agent files, run as an ``AgentInstance``.

Such a file has no classes, only module-level functions::

    async def step(state, action, label, **kwargs):       # `def` works too
        # state: the text so far (prompt + earlier turns and feedback); action: the model's latest turn
        return reward, next_state, done, extra_info         # tuple form (the 4th item is optional)
        # or a dict: {"rewards", "scores"?, "next_state" | "next_observation", "done",
        #             "sampling_params"?, "extra_logs"?}

    async def reset(states, **kwargs):                     # optional; states: {"observation", "label"}
        return {"observation": states["observation"]}      # or the observation string

``next_state`` must be ``state + action + feedback``: the executor is token in / token out, so only the
feedback part is tokenized and appended (never trained on). Module-level variables are shared by every
episode, as they were in OpenRLHF. ``train.agent_kwargs`` reach ``step`` / ``reset`` as keyword arguments
when their signatures accept them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hpc_rlhf.agents.multi_turn import AgentInstanceBase
from hpc_rlhf.agents.step_output import AgentOutputError
from hpc_rlhf.utils.user_code import accepted_kwargs

_NEXT_TEXT_KEYS = ("next_state", "next_observation")


def is_function_style(module: ModuleType) -> bool:
    return callable(getattr(module, "step", None)) and not inspect.isclass(module.step)


def _to_step_dict(output: Any, state: str, action: str) -> dict[str, Any]:
    """A function-style ``step`` result -> the class-style dict (``environment_feedback`` instead of the full text)."""
    if isinstance(output, tuple):
        if len(output) not in (3, 4):
            raise AgentOutputError(f"function-style step must return (reward, next_state, done[, extra_info]), "
                                   f"got a tuple of {len(output)}")
        reward, next_text, done = output[:3]
        extra = output[3] if len(output) == 4 else {}
        result: dict[str, Any] = {"rewards": reward, "done": done, "extra_logs": extra or {}}
    elif isinstance(output, dict):
        key = next((k for k in _NEXT_TEXT_KEYS if k in output), None)
        if key is None:
            if "environment_feedback" in output:
                return output  # already the class-style dict
            raise AgentOutputError(f"function-style step output needs 'next_state' (state + action + feedback); "
                                   f"has keys {sorted(output)}")
        next_text = output[key]
        result = {k: v for k, v in output.items() if k not in _NEXT_TEXT_KEYS}
    else:
        raise AgentOutputError(f"function-style step must return a tuple or a dict, got {type(output).__name__}")
    if not isinstance(next_text, str):
        raise AgentOutputError(f"function-style step: next_state must be a str, got {type(next_text).__name__}")
    prefix = state + action
    if not next_text.startswith(prefix):
        raise AgentOutputError(
            "function-style step: next_state must start with state + action (the text it was given) and add only "
            "the environment feedback; this executor appends feedback tokens and never re-tokenizes earlier text")
    result["environment_feedback"] = next_text[len(prefix):]
    return result


def function_agent_class(module: ModuleType) -> type:
    """An ``AgentInstance`` class whose ``step`` / ``reset`` call the module's functions.

    Each wrapper is ``async`` exactly when the user's function is, so a blocking plain ``def`` runs in a
    worker thread like any sync agent method and cannot stall the other episodes.
    """
    step_fn: Callable[..., Any] = module.step
    reset_fn: Callable[..., Any] | None = getattr(module, "reset", None)

    def step_args(states: dict, kwargs: dict) -> tuple[tuple, dict]:
        offered = {"sampling_params": states.get("sampling_params"), **kwargs}
        args = (states["observation_text"], states["action_text"], states["label"])
        return args, accepted_kwargs(step_fn, offered)

    def reset_result(value: Any, states: dict) -> dict:
        if isinstance(value, str):
            return {"observation": value}
        if value is None:
            return {"observation": states["observation"]}
        return value

    # Methods picked per user function (async exactly when it is): the class is built from them, as a class
    # statement could only define them conditionally.
    async def async_step(self: _FunctionAgent, states: dict, **kwargs: Any) -> dict:
        args, kw = step_args(states, {**self.kwargs, **kwargs})
        return _to_step_dict(await step_fn(*args, **kw), args[0], args[1])

    def sync_step(self: _FunctionAgent, states: dict, **kwargs: Any) -> dict:
        args, kw = step_args(states, {**self.kwargs, **kwargs})
        return _to_step_dict(step_fn(*args, **kw), args[0], args[1])

    name = f"FunctionAgent[{module.__name__}]"
    methods: dict[str, Any] = {"__qualname__": name,
                               "step": async_step if inspect.iscoroutinefunction(step_fn) else sync_step}
    if reset_fn is not None:
        async def async_reset(self: _FunctionAgent, states: dict, **kwargs: Any) -> dict:
            kw = accepted_kwargs(reset_fn, {**self.kwargs, **kwargs})
            return reset_result(await reset_fn(states, **kw), states)

        def sync_reset(self: _FunctionAgent, states: dict, **kwargs: Any) -> dict:
            kw = accepted_kwargs(reset_fn, {**self.kwargs, **kwargs})
            return reset_result(reset_fn(states, **kw), states)

        methods["reset"] = async_reset if inspect.iscoroutinefunction(reset_fn) else sync_reset
    return type(name, (_FunctionAgent,), methods)


class _FunctionAgent(AgentInstanceBase):
    """What every function-style agent class shares: ``train.agent_kwargs``, handed to every step / reset call."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
