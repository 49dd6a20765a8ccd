"""Secrets out of what a run writes: saved configs, logger configs, log lines.

* A value given as ``${oc.env:NAME}`` (an API key in ``train.agent_kwargs``, a token) is resolved for the run,
  but what is saved or logged keeps the ``${oc.env:NAME}`` form: ``load_config`` records where such
  interpolations were (:func:`env_interpolations`, kept for the process in :data:`ENV_SOURCES`) and
  :func:`public_config` puts them back.
* Credentials inside a URL (``http://user:password@host``) are masked as ``http://***@host`` in every string.

Imports no torch (it is part of ``hpc_rlhf.config``).
"""

from __future__ import annotations

import re
from typing import Any

_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
ENV_RESOLVER = "oc.env"
# The keys and list indices from a config's root to one of its leaves.
ConfigPath = tuple[str | int, ...]
# Where the configs loaded in this process read the environment: {path: (the ${oc.env:...} text, its value)}.
# Module-wide rather than on the config object, so copies of the config (model_copy, pickling) keep it.
ENV_SOURCES: dict[ConfigPath, tuple[str, str]] = {}


def mask_url_credentials(text: str) -> str:
    """``scheme://user:password@host...`` -> ``scheme://***@host...`` wherever a URL appears in ``text``."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}***@", text)


def env_interpolations(unresolved: Any, resolved: Any, path: ConfigPath = ()) -> dict[ConfigPath, tuple[str, str]]:
    """``{path: (text, resolved value)}`` of every string leaf of an unresolved OmegaConf container that reads
    the environment (``${oc.env:...}``); ``path`` is the tuple of keys / list indices to the leaf."""
    found: dict[ConfigPath, tuple[str, str]] = {}
    if isinstance(unresolved, dict) and isinstance(resolved, dict):
        for key, value in unresolved.items():
            found.update(env_interpolations(value, resolved.get(key), (*path, key)))
    elif isinstance(unresolved, list) and isinstance(resolved, list):
        for index, value in enumerate(unresolved[: len(resolved)]):
            found.update(env_interpolations(value, resolved[index], (*path, index)))
    elif isinstance(unresolved, str) and "${" + ENV_RESOLVER + ":" in unresolved.replace(" ", ""):
        found[path] = (unresolved, str(resolved))
    return found


def _mask_strings(value: Any) -> Any:
    if isinstance(value, str):
        return mask_url_credentials(value)
    if isinstance(value, dict):
        return {k: _mask_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_strings(v) for v in value]
    return value


def public_config(data: dict[str, Any],
                  env_sources: dict[ConfigPath, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A copy of a config dump (``model_dump(mode="json")``) fit to save or log: every leaf that came from
    ``${oc.env:...}`` (and still holds the value it resolved to) back in that form, and URL credentials masked."""
    out: dict[str, Any] = _mask_strings(data)
    for path, (text, resolved) in (ENV_SOURCES if env_sources is None else env_sources).items():
        node: Any = out
        try:
            for key in path[:-1]:
                node = node[key]
            if str(node[path[-1]]) == mask_url_credentials(resolved):
                node[path[-1]] = text
        except (KeyError, IndexError, TypeError):
            continue  # a key the schema dropped or renamed
    return out
