"""Load a user agent file (``train.agent_func_path``) into an ``AgentExecutor``.

Every file shape OpenRLHF has documented loads unchanged: ``from openrlhf.utils.agent import ...`` resolves to
``hpc_rlhf.agents.multi_turn``'s classes while the file loads when ``openrlhf`` is not installed
(``openrlhf_alias``); importing them from ``hpc_rlhf.agents.multi_turn`` directly works too (see
``docs/agents_from_openrlhf.md`` for a minimal example of each):

* ``AgentInstance`` + ``AgentExecutor(MultiTurnAgentExecutor)``: the executor is built with the arguments
  its ``__init__`` names (none, as in OpenRLHF, or ``agent_instance_cls``), its ``agent_instance_cls`` taken
  from the file's ``AgentInstance`` when its ``__init__`` did not set one, then configured with the budgets.
* only ``AgentInstance``: run by a plain ``MultiTurnAgentExecutor``.
* ``AgentExecutor(AgentExecutorBase)`` with OpenRLHF's ``__init__(self, max_steps, max_length, llm_engine,
  hf_tokenizer, result_queue)``: those arguments are supplied (``llm_engine`` / ``result_queue`` are None);
  an ``execute`` override is honoured when it wraps ``super().execute(...)``.
* function style: module-level ``step(state, action, label, **kwargs)`` (+ optional ``reset``), run through
  ``function_agent.function_agent_class``.
* OpenAI-client agents: a module-level ``async def run_episode(client, prompt, label, **agent_kwargs)``, or one
  class defined in the file with ``async def arun_episode(self, client, data)`` (AReaL's workflow shape, built
  once per rollout rank with ``train.agent_kwargs``), and no ``AgentInstance`` / ``AgentExecutor``; run by
  ``openai_executor.OpenAIAgentExecutor`` against this rank's OpenAI-compatible endpoint; ``num_concurrent``
  bounds the episodes alive at once, ``episode_timeout_s`` each episode's wall time (needs the ``agents``
  extra: ``pip install 'hpc-rlhf[agents]'``).
* ``AgentExecutor`` subclassing the base ``hpc_rlhf.agents.executor.AgentExecutor`` (advanced: your
  own ``run()``): built as ``AgentExecutor(tokenizer, prompt_max_len, **settings)``, where settings
  are those of ``max_len``, ``max_turns``, ``num_concurrent``, ``step_timeout_s``, ``agent_kwargs`` its
  ``__init__`` accepts.

``train.agent_kwargs`` go to ``AgentInstance(...)`` and ``reset(...)`` (the names their signatures accept).
Every problem raises ``AgentLoadError`` naming the file and what to change.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from typing import Any

from hpc_rlhf.agents.executor import AgentExecutor
from hpc_rlhf.agents.function_agent import function_agent_class, is_function_style
from hpc_rlhf.agents.multi_turn import MultiTurnAgentExecutor
from hpc_rlhf.agents.openai_executor import OpenAIAgentExecutor, import_openai, is_workflow
from hpc_rlhf.agents.openrlhf_alias import openrlhf_agent_alias
from hpc_rlhf.agents.tool_parsers import ParserConfigError
from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.utils.user_code import UserCodeImportError, accepted_kwargs, import_user_file

_IMPORT_HINT = ("import AgentInstanceBase, AgentExecutorBase or MultiTurnAgentExecutor from "
                "`openrlhf.utils.agent` (aliased to hpc_rlhf's classes while the file loads) or "
                "`hpc_rlhf.agents.multi_turn`; no other openrlhf module is available without the openrlhf package")


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
        with openrlhf_agent_alias(path):
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


def _constructor_args(cls: type[MultiTurnAgentExecutor], supplied: dict[str, Any], path: str) -> dict[str, Any]:
    """The arguments ``cls.__init__`` names, from ``supplied``; an error for any other required one."""
    if cls.__init__ is object.__init__:
        return {}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # drop self
    kwargs: dict[str, Any] = {}
    missing = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in supplied:
            kwargs[p.name] = supplied[p.name]
        elif p.default is inspect.Parameter.empty:
            missing.append(p.name)
    if missing:
        raise AgentLoadError(
            f"{path}: AgentExecutor.__init__ requires {missing}, which the trainer cannot supply; it can pass "
            f"{sorted(supplied)} (OpenRLHF's max_steps, max_length, llm_engine, hf_tokenizer, result_queue "
            "included). Give the others defaults or read them from train.agent_kwargs", path=path)
    return kwargs


def _check_execute_override(cls: type[MultiTurnAgentExecutor], path: str) -> None:
    """An ``execute`` override must wrap ``super().execute``: generation is the executor's, not the file's."""
    if cls.execute is MultiTurnAgentExecutor.execute:
        return
    try:
        source = inspect.getsource(cls.execute)
    except (OSError, TypeError):
        return  # no source to read: the executor checks at run time
    if "super(" not in source or ".execute(" not in source:
        raise AgentLoadError(
            f"{path}: AgentExecutor.execute is overridden without calling super().execute(prompt, label, "
            "sampling_params). This trainer generates tokens itself (token in / token out) and gives agent code "
            "no vLLM engine, so an execute override may only wrap `await super().execute(...)` (changing the "
            "prompt or label before, or reward/scores/extra_logs of the dict it returns after). Move per-turn "
            "logic (tool calls, feedback) into AgentInstance.step, or subclass "
            "hpc_rlhf.agents.executor.AgentExecutor and implement run()", path=path)


def _workflow_classes(module: Any) -> list[type[Any]]:
    """Classes defined in the agent file (not imported into it) with an ``async def arun_episode`` (``Any``: user
    classes, built with whatever ``train.agent_kwargs`` their ``__init__`` accepts)."""
    return [obj for obj in vars(module).values()
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and is_workflow(obj)]


def _openai_agent(module: Any, path: str, agent_kwargs: dict[str, Any]) -> Any:
    """The file's OpenAI-client agent: its ``run_episode`` function or an instance of its workflow class;
    None when it has neither."""
    workflows = _workflow_classes(module)
    run_episode = getattr(module, "run_episode", None)
    if run_episode is not None and workflows:
        raise AgentLoadError(f"{path} defines both `run_episode` and the workflow class {workflows[0].__name__} "
                             "(async def arun_episode): keep one of the two OpenAI-client agent shapes", path=path)
    if len(workflows) > 1:
        raise AgentLoadError(f"{path} defines {len(workflows)} workflow classes with `async def arun_episode` "
                             f"({', '.join(c.__name__ for c in workflows)}): keep one per agent file", path=path)
    if run_episode is not None:
        if not inspect.iscoroutinefunction(run_episode):
            raise AgentLoadError(f"{path}: run_episode must be `async def run_episode(client, prompt, label, "
                                 "**agent_kwargs)` (the client is an openai.AsyncOpenAI)", path=path)
        return run_episode
    if not workflows:
        return None
    cls = workflows[0]
    kwargs = accepted_kwargs(cls.__init__, agent_kwargs) if cls.__init__ is not object.__init__ else {}
    try:
        return cls(**kwargs)
    except Exception as err:
        raise AgentLoadError(f"{path}: building the workflow {cls.__name__}(**{sorted(kwargs)}) from "
                             f"train.agent_kwargs failed: {type(err).__name__}: {err}", path=path) from err


def _openai_executor(agent: Any, path: str, tokenizer: Tokenizer, prompt_max_len: int, max_len: int | None,
                     num_concurrent: int, episode_timeout_s: float | None, agent_kwargs: dict[str, Any],
                     tool_call_parser: str, reasoning_parser: str, endpoint_listen: str) -> AgentExecutor:
    try:
        import_openai()
    except ImportError as err:
        raise AgentLoadError(f"{path} defines an OpenAI-client agent: {err}", path=path) from err
    try:
        return OpenAIAgentExecutor(agent, tokenizer, prompt_max_len, max_len=max_len,
                                   num_concurrent=num_concurrent, episode_timeout_s=episode_timeout_s,
                                   agent_kwargs=agent_kwargs, tool_call_parser=tool_call_parser,
                                   reasoning_parser=reasoning_parser, endpoint_listen=endpoint_listen)
    except ParserConfigError as err:
        raise AgentLoadError(f"{path} defines an OpenAI-client agent: {err}", path=path) from err


def load_agent_executor(path: str, tokenizer: Tokenizer, prompt_max_len: int, max_len: int | None = None,
                        max_turns: int = 8, num_concurrent: int = 256,
                        step_timeout_s: float | None = 300.0,
                        agent_kwargs: dict[str, Any] | None = None,
                        episode_timeout_s: float | None = 600.0, tool_call_parser: str = "auto",
                        reasoning_parser: str = "auto", endpoint_listen: str = "unix") -> AgentExecutor:
    """The executor defined by the agent file at ``path`` (see the module docstring); the parsers are those of
    an OpenAI-client agent's endpoint (``tool_parsers``), and so is ``endpoint_listen`` (``openai_endpoint``)."""
    path = os.path.abspath(os.path.expanduser(path))
    agent_kwargs = dict(agent_kwargs or {})
    module = _import_file(path)
    executor_cls = getattr(module, "AgentExecutor", None)
    instance_cls = getattr(module, "AgentInstance", None)
    openai_agent = _openai_agent(module, path, agent_kwargs) if executor_cls is None and instance_cls is None else None
    if openai_agent is not None:
        return _openai_executor(openai_agent, path, tokenizer, prompt_max_len, max_len, num_concurrent,
                                episode_timeout_s, agent_kwargs, tool_call_parser, reasoning_parser,
                                endpoint_listen)
    if executor_cls is None and instance_cls is None:
        if not is_function_style(module):
            raise AgentLoadError(
                f"{path} defines neither AgentInstance nor AgentExecutor nor a module-level step function: an "
                "agent file defines `class AgentInstance(AgentInstanceBase)` with async reset(states) / "
                "step(states) (see examples/agents/math_retry_agent.py), `async def run_episode(client, prompt, "
                "label)` or a class with `async def arun_episode(self, client, data)` for an OpenAI-client agent "
                "(examples/agents/openai_math_agent.py, examples/agents/openai_branching_agent.py), or OpenRLHF's "
                "older `async def step(state, action, label, **kwargs)` function (docs/agents_from_openrlhf.md)",
                path=path)
        instance_cls = function_agent_class(module)
    settings = {"max_len": max_len, "max_turns": max_turns, "num_concurrent": num_concurrent,
                "step_timeout_s": step_timeout_s}

    if executor_cls is not None and not (inspect.isclass(executor_cls) and issubclass(executor_cls, AgentExecutor)):
        raise AgentLoadError(
            f"{path}: AgentExecutor must subclass hpc_rlhf.agents.multi_turn.MultiTurnAgentExecutor or "
            "AgentExecutorBase (or, to write run() yourself, hpc_rlhf.agents.executor.AgentExecutor); "
            f"{_IMPORT_HINT}", path=path)

    if executor_cls is not None and not issubclass(executor_cls, MultiTurnAgentExecutor):
        kwargs = accepted_kwargs(executor_cls.__init__, {**settings, "agent_kwargs": agent_kwargs})
        try:
            return executor_cls(tokenizer, prompt_max_len, **kwargs)
        except Exception as err:
            raise AgentLoadError(f"{path}: building AgentExecutor(tokenizer, prompt_max_len, **{sorted(kwargs)}) "
                                 f"failed: {type(err).__name__}: {err}", path=path) from err

    if executor_cls is None:
        executor_cls = MultiTurnAgentExecutor
    _check_execute_override(executor_cls, path)
    # What an OpenRLHF executor's __init__ may name; llm_engine / result_queue have no counterpart here.
    supplied = {"max_steps": max_turns, "max_length": max_len, "llm_engine": None, "hf_tokenizer": tokenizer,
                "result_queue": None, "tokenizer": tokenizer, "prompt_max_len": prompt_max_len,
                "agent_instance_cls": instance_cls, "agent_kwargs": agent_kwargs, **settings}
    kwargs = _constructor_args(executor_cls, supplied, path)
    try:
        executor = executor_cls(**kwargs)
    except Exception as err:
        raise AgentLoadError(f"{path}: AgentExecutor({', '.join(kwargs)}) failed: {type(err).__name__}: {err}",
                             path=path) from err
    if executor.agent_instance_cls is None:
        if instance_cls is None:
            raise AgentLoadError(
                f"{path} defines AgentExecutor but no AgentInstance class: add "
                "`class AgentInstance(AgentInstanceBase)` with async reset(states) / step(states), or pass it "
                "with `super().__init__(MyInstance)` in AgentExecutor.__init__", path=path)
        executor.agent_instance_cls = instance_cls
    _check_instance_cls(executor.agent_instance_cls, path)
    try:
        executor.configure(tokenizer=tokenizer, prompt_max_len=prompt_max_len, agent_kwargs=agent_kwargs,
                           max_len=max_len, max_turns=max_turns, num_concurrent=num_concurrent,
                           step_timeout_s=step_timeout_s)
    except ValueError as err:
        raise AgentLoadError(f"{path}: {err}", path=path) from err
    return executor
