"""Import a user's Python file (reward function, agent) under a module name unique to its path, within a time
limit, and pass it only the keyword arguments its functions accept.

The import runs in a daemon thread (``utils.user_calls``) and is abandoned after ``IMPORT_TIMEOUT_S``: a file
that blocks at import time (a network call, a lock, ``input()``) fails the start-up naming the file instead of
hanging every rank until the watchdog. Module-level code therefore runs outside the main thread
(``signal.signal`` at import time is not possible there)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hpc_rlhf.utils.user_calls import UserCallTimeout, call_in_thread

IMPORT_TIMEOUT_S = 300.0  # loading a model or a dataset at import time fits; a hang does not


class UserCodeImportError(ImportError):
    """The file could not be imported; ``__cause__`` is the user's exception."""


def import_user_file(path: str, kind: str, timeout_s: float | None = IMPORT_TIMEOUT_S) -> ModuleType:
    """Execute ``path`` as module ``hpc_rlhf_user_<kind>_<hash>`` (two files never shadow each other), within
    ``timeout_s`` (None: no limit, in the caller's thread).

    Raises:
        UserCodeImportError: the file is not importable, raised while importing, or did not finish within
            ``timeout_s``; the caller wraps it in its own error that names the config key.
    """
    module_name = f"hpc_rlhf_user_{kind}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserCodeImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        if timeout_s is None:
            spec.loader.exec_module(module)
        else:
            call_in_thread(spec.loader.exec_module, module, timeout_s=timeout_s, what=f"importing {path}")
    except UserCallTimeout:
        sys.modules.pop(module_name, None)
        raise UserCodeImportError(f"importing {path} did not finish within {timeout_s:g} s (module-level code "
                                  "that blocks: a network call, a lock, input()); the import was abandoned") from None
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise UserCodeImportError(f"{type(err).__name__}: {err}") from err
    return module


def accepted_kwargs(func: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``func``'s signature accepts (all of them with ``**kwargs``, or when the
    signature cannot be read)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    named_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in params if p.kind in named_kinds}
    return {k: v for k, v in kwargs.items() if k in names}
