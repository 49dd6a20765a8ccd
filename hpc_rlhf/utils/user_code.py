"""Import a user's Python file (reward function, agent) under a module name unique to its path."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from types import ModuleType


class UserCodeImportError(ImportError):
    """The file could not be imported; ``__cause__`` is the user's exception."""


def import_user_file(path: str, kind: str) -> ModuleType:
    """Execute ``path`` as module ``hpc_rlhf_user_<kind>_<hash>`` (two files never shadow each other).

    Raises:
        UserCodeImportError: the file is not importable or raised while importing; the caller wraps it
            in its own error that names the config key.
    """
    module_name = f"hpc_rlhf_user_{kind}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserCodeImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise UserCodeImportError(f"{type(err).__name__}: {err}") from err
    return module
