"""Load a user agent file (``train.agent_func_path``) into an ``AgentExecutor``.

The file defines, in OpenRLHF's format (only the import changes)::

    from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor

    class AgentInstance(AgentInstanceBase): ...          # async reset(states) / step(states)
    class AgentExecutor(MultiTurnAgentExecutor): pass    # or __init__ calling super().__init__(AgentInstance)

Accepted shapes:

* ``AgentExecutor`` subclassing ``MultiTurnAgentExecutor``: built with no arguments (as OpenRLHF
  does), its ``agent_instance_cls`` taken from the file's ``AgentInstance`` when its ``__init__``
  did not set one, then configured with the token budgets below.
* only ``AgentInstance``: run by a plain ``MultiTurnAgentExecutor``.
* ``AgentExecutor`` subclassing the base ``hpc_rlhf.agents.executor.AgentExecutor`` (advanced: your
  own ``run()``): built as ``AgentExecutor(tokenizer, prompt_max_len, **settings)``, where settings
  are those of ``max_len``, ``max_turns``, ``num_concurrent``, ``step_timeout_s`` its ``__init__``
  accepts.

Every problem raises ``AgentLoadError`` naming the file.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from typing import Any

from hpc_rlhf.agents.executor import AgentExecutor
from hpc_rlhf.agents.multi_turn import MultiTurnAgentExecutor
from hpc_rlhf.utils.user_code import UserCodeImportError, import_user_file

_IMPORT_HINT = ("write `from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor` "
                "(instead of `from openrlhf.utils.agent import ...`)")


class AgentLoadError(RuntimeError):
    """A user agent file could not be loaded or does not define a usable agent."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise AgentLoadError(f"agent file {path} does not exist (train.agent_func_path)", path=path)
    folder = os.path.dirname(path)
    if folder not in sys.path:  # agent files often import helpers that sit next to them
        sys.path.append(folder)
    try:
        return import_user_file(path, "agent")
    except UserCodeImportError as err:
        hint = f"; {_IMPORT_HINT}" if "openrlhf" in str(err) else ""
        raise AgentLoadError(f"importing agent file {path} failed: {err}{hint}\n{traceback.format_exc()}",
                             path=path) from err


def _check_instance_cls(cls: Any, path: str) -> None:
    if not inspect.isclass(cls):
        raise AgentLoadError(f"{path}: AgentInstance must be a class, got {type(cls).__name__}", path=path)
    step = getattr(cls, "step", None)
    if not callable(step) or getattr(step, "__isabstractmethod__", False):
        raise AgentLoadError(f"{path}: AgentInstance must implement `async def step(self, states)`; "
                             f"subclass AgentInstanceBase ({_IMPORT_HINT})", path=path)


def load_agent_executor(path: str, tokenizer: Any, prompt_max_len: int, max_len: int | None = None,
                        max_turns: int = 8, num_concurrent: int = 256,
                        step_timeout_s: float | None = 300.0) -> AgentExecutor:
    """The executor defined by the agent file at ``path`` (see the module docstring)."""
    path = os.path.abspath(os.path.expanduser(path))
    module = _import_file(path)
    executor_cls = getattr(module, "AgentExecutor", None)
    instance_cls = getattr(module, "AgentInstance", None)
    if executor_cls is None and instance_cls is None:
        raise AgentLoadError(
            f"{path} defines neither AgentInstance nor AgentExecutor: an agent file defines "
            "`class AgentInstance(AgentInstanceBase)` with async reset(states) / step(states) and "
            "`class AgentExecutor(MultiTurnAgentExecutor)` (see examples/agents/math_retry_agent.py)", path=path)
    settings = {"max_len": max_len, "max_turns": max_turns, "num_concurrent": num_concurrent,
                "step_timeout_s": step_timeout_s}

    if executor_cls is not None and not (inspect.isclass(executor_cls) and issubclass(executor_cls, AgentExecutor)):
        raise AgentLoadError(
            f"{path}: AgentExecutor must subclass hpc_rlhf.agents.multi_turn.MultiTurnAgentExecutor (or, to write "
            f"run() yourself, hpc_rlhf.agents.executor.AgentExecutor); {_IMPORT_HINT}", path=path)

    if executor_cls is not None and not issubclass(executor_cls, MultiTurnAgentExecutor):
        accepted = inspect.signature(executor_cls.__init__).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        kwargs = {k: v for k, v in settings.items() if takes_all or k in accepted}
        try:
            return executor_cls(tokenizer, prompt_max_len, **kwargs)
        except Exception as err:
            raise AgentLoadError(f"{path}: building AgentExecutor(tokenizer, prompt_max_len, **{sorted(kwargs)}) "
                                 f"failed: {type(err).__name__}: {err}", path=path) from err

    if executor_cls is None:
        executor_cls = MultiTurnAgentExecutor
    try:
        executor = executor_cls()
    except Exception as err:
        raise AgentLoadError(f"{path}: AgentExecutor() failed: {type(err).__name__}: {err} (it is built with no "
                             "arguments, as in OpenRLHF)", path=path) from err
    if executor.agent_instance_cls is None:
        if instance_cls is None:
            raise AgentLoadError(
                f"{path} defines AgentExecutor but no AgentInstance class: add "
                "`class AgentInstance(AgentInstanceBase)` with async reset(states) / step(states), or pass it "
                "with `super().__init__(MyInstance)` in AgentExecutor.__init__", path=path)
        executor.agent_instance_cls = instance_cls
    _check_instance_cls(executor.agent_instance_cls, path)
    try:
        executor.configure(tokenizer=tokenizer, prompt_max_len=prompt_max_len, **settings)
    except ValueError as err:
        raise AgentLoadError(f"{path}: {err}", path=path) from err
    return executor
