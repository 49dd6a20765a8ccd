"""``from openrlhf.utils.agent import ...`` in an unchanged OpenRLHF agent file, without the ``openrlhf`` package.

While the agent loader executes the user's file (and only then), :func:`openrlhf_agent_alias` puts three
module objects in ``sys.modules`` - ``openrlhf``, ``openrlhf.utils`` and ``openrlhf.utils.agent`` - whose
``agent`` module holds this project's counterparts of OpenRLHF's names (``AgentInstanceBase``,
``AgentExecutorBase``, ``MultiTurnAgentExecutor``). They are removed afterwards, so nothing else in the
process sees a fake ``openrlhf``; the user's module keeps the classes it imported. When the real ``openrlhf``
is importable nothing is aliased: the file gets the real package, as it would under OpenRLHF.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from typing import ClassVar

from hpc_rlhf.agents.multi_turn import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor

logger = logging.getLogger(__name__)

ALIASED_MODULES = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")
_logged = False


class _AgentModule(types.ModuleType):
    """``openrlhf.utils.agent``'s stand-in; it notes that a name was read from it (to log the alias once)."""

    _names: ClassVar[dict[str, type]] = {"AgentInstanceBase": AgentInstanceBase, "AgentExecutorBase": AgentExecutorBase,
              "MultiTurnAgentExecutor": MultiTurnAgentExecutor}
    used = False

    def __getattr__(self, name: str) -> object:  # only called for names not set on the module
        if name not in self._names:
            raise AttributeError(f"openrlhf.utils.agent (aliased to hpc_rlhf.agents.multi_turn while an agent file "
                                 f"loads) has no {name!r}; it has {sorted(self._names)}")
        self.used = True
        return self._names[name]


def _real_openrlhf_installed() -> bool:
    if "openrlhf" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("openrlhf") is not None
    except (ImportError, ValueError):
        return False


def _alias_modules() -> dict[str, types.ModuleType]:
    root, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
    agent = _AgentModule("openrlhf.utils.agent", "hpc_rlhf's counterparts of openrlhf.utils.agent (an alias).")
    for module in (root, utils):
        module.__path__ = []  # packages, so `import openrlhf.utils.agent` resolves through sys.modules
    # each submodule an attribute of its package, as the import system sets it (ModuleType declares no such names)
    vars(root)["utils"], vars(utils)["agent"] = utils, agent
    return dict(zip(ALIASED_MODULES, (root, utils, agent), strict=True))


@contextlib.contextmanager
def openrlhf_agent_alias(path: str) -> Iterator[None]:
    """Make ``openrlhf.utils.agent`` importable inside the block when the real package is not installed."""
    if _real_openrlhf_installed():
        yield
        return
    aliases = _alias_modules()
    sys.modules.update(aliases)
    try:
        yield
    finally:
        for name, module in aliases.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        if aliases["openrlhf.utils.agent"].used:
            _log_once(path)


def _log_once(path: str) -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info("%s imports openrlhf.utils.agent, which is not installed: its AgentInstanceBase / "
                    "AgentExecutorBase / MultiTurnAgentExecutor are hpc_rlhf.agents.multi_turn's while the file "
                    "loads (docs/agents_from_openrlhf.md)", path)
