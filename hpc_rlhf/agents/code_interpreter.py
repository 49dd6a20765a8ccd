"""A Python code interpreter for multi-turn agents, run in the sandbox, with state kept across an episode's turns.

One :class:`CodeInterpreter` per episode (create it in ``AgentInstance.__init__`` or per ``run_episode``). Each
call runs in a fresh sandboxed process; the state of earlier calls (variables, functions, imports) is rebuilt by
replaying the cells that succeeded, with their output discarded, before the new cell runs. So the interpreter
needs no long-lived process per episode, and a cell that crashes leaves the state as it was before it. The price:
earlier cells run again (their cost grows with the turns, and their side effects, such as random draws, repeat).
As in Jupyter, a last line that is an expression has its ``repr`` printed.

Its output goes back to the model as a tool message (OpenAI-client agents: ``{"role": "tool", ...}``; OpenRLHF
agent files: the step's ``environment_feedback``); either way it is masked from the loss. ``stats()`` gives the
episode's number of calls and sandbox seconds, for the step's ``extra_logs``: the seconds are logged as
``timing/tools/code_interpreter`` (summed over the step's episodes, beside the step's phase timings), the calls
as ``extra/code_interpreter_calls`` (mean per episode).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from hpc_rlhf.sandbox.result import ExecRequest, Sandbox

# Runs inside the sandbox: replays the earlier cells silently, then runs the new one (last expression echoed).
_HARNESS = '''\
import ast, contextlib, io, json
cells = json.load(open("cells.json"))
ns = {"__name__": "__main__"}
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    for i, src in enumerate(cells[:-1]):
        exec(compile(src, f"<cell {i}>", "exec"), ns)
name = f"<cell {len(cells) - 1}>"
tree = ast.parse(cells[-1], name)
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
exec(compile(tree, name, "exec"), ns)
if last is not None:
    value = eval(compile(ast.Expression(last.value), name, "eval"), ns)
    if value is not None:
        print(repr(value))
'''

TOOL_NAME = "python"
TIMING_KEY = "timing/tools/code_interpreter"  # rollout_health.TOOL_TIMING_PREFIX + the tool's name


def tool_spec(name: str = TOOL_NAME) -> dict[str, Any]:
    """The OpenAI function-tool definition to pass in ``tools=[...]`` of a chat completion."""
    return {"type": "function", "function": {
        "name": name,
        "description": "Run Python code and return what it prints (the last expression's value is shown). "
                       "Variables and functions persist across calls in this conversation. No network.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python code"}},
                       "required": ["code"]}}}


class CodeInterpreter:
    """Runs an episode's cells in ``sandbox``; see the module docstring.

    Args:
        sandbox: a local or remote sandbox (:func:`hpc_rlhf.sandbox.factory.make_sandbox`), shared by episodes.
        time_limit_s: wall-clock limit of one call (replay included).
        max_output_chars: longer output is cut, keeping its head and tail.
    """

    def __init__(self, sandbox: Sandbox, time_limit_s: float = 10.0, max_output_chars: int = 2000):
        self.sandbox = sandbox
        self.time_limit_s = time_limit_s
        self.max_output_chars = max_output_chars
        self.cells: list[str] = []  # the cells that succeeded, replayed before each new one
        self.num_calls = 0
        self.sandbox_s = 0.0

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        half = self.max_output_chars // 2
        return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"

    def run(self, code: str) -> str:
        """Run one cell; returns the text for the tool message (output, or the error and its traceback)."""
        start = time.monotonic()
        request = ExecRequest(code=_HARNESS, time_limit_s=self.time_limit_s,
                              files={"cells.json": json.dumps([*self.cells, code])})
        result = self.sandbox.run(request)
        self.num_calls += 1
        self.sandbox_s += time.monotonic() - start
        if result.status == "ok":
            self.cells.append(code)
            return self._clip(result.stdout) if result.stdout else "(no output)"
        reason = {"timeout": f"timed out after {self.time_limit_s:g} s", "output_limit": "output limit exceeded",
                  "memory_limit": "memory limit exceeded", "sandbox_error": "the sandbox failed"}.get(result.status)
        text = result.stdout + result.stderr
        if reason:
            text = f"{text}\n[{reason}]" if text else f"[{reason}]"
        return self._clip(text.strip())

    async def arun(self, code: str) -> str:
        """:meth:`run` in a worker thread, so an agent's event loop keeps serving other episodes meanwhile."""
        return await asyncio.to_thread(self.run, code)

    def tool_message(self, tool_call_id: str, arguments: str) -> dict[str, str]:
        """Run an OpenAI tool call's JSON ``arguments`` (``{"code": ...}``) and build the ``role: tool`` message."""
        try:
            code = json.loads(arguments)["code"]
        except (ValueError, KeyError, TypeError):
            content = f'[the arguments must be JSON {{"code": "..."}}, got {arguments[:200]!r}]'
        else:
            content = self.run(str(code))
        return {"role": "tool", "tool_call_id": tool_call_id, "content": content}

    def stats(self) -> dict[str, float]:
        """This episode's ``code_interpreter_calls`` and sandbox wall seconds (``timing/tools/code_interpreter``:
        the trainer logs that name as it is, summed over the step's episodes)."""
        return {"code_interpreter_calls": float(self.num_calls), TIMING_KEY: self.sandbox_s}
