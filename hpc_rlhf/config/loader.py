"""Load a run config: YAML recipe, then dotted command-line overrides, then validation.

OmegaConf does the YAML reading and the dotted-override merge; pydantic does the
typing and validation. Errors are re-worded so that they name the dotted key, the
file it came from and what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, get_args, overload

import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel, ValidationError

from hpc_rlhf.config.redact import ENV_SOURCES, env_interpolations, public_config
from hpc_rlhf.config.schema import RunConfig

RESOLVED_CONFIG_NAME = "config.resolved.yaml"
T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key at fault."""


def normalize_overrides(argv: Sequence[str]) -> list[str]:
    """Turn ``['--a.b', '1', 'c.d=2', '--e=3']`` into ``['a.b=1', 'c.d=2', 'e=3']``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        key = token[2:] if token.startswith("--") else token
        if "=" in key:
            out.append(key)
        elif token.startswith("--") and i + 1 < len(argv):
            out.append(f"{key}={argv[i + 1]}")
            i += 1
        else:
            raise ConfigError(f"override {token!r} is not of the form key=value (e.g. algo.kl.init_coef=0.01)")
        i += 1
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text: {err}") from err
    except RecursionError:
        raise ConfigError(f"config file {path} nests too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section that contains the dotted location ``loc``."""
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        candidates = [field.annotation, *get_args(field.annotation)]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return []
        model = nested[0]
    return sorted(model.model_fields)


def _format_validation_error(root: type[BaseModel], err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in err.errors():
        loc = tuple(item["loc"])
        key = ".".join(str(p) for p in loc) or "config"
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(root, loc)) or "?"
            lines.append(f"  {key}: unknown key; allowed here: {allowed}")
        else:
            value = item.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            lines.append(f"  {key}: {item['msg']}{shown}")
    return "\n".join(lines)


@overload
def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig: ...


@overload
def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, root: type[T]) -> T: ...


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                root: type[BaseModel] = RunConfig) -> BaseModel:
    """Build a config tree (``root``: the RL ``RunConfig`` by default) from YAML and ``key=value`` overrides.

    Raises:
        ConfigError: naming the file and the dotted key at fault.
    """
    base = _read_yaml(Path(path)) if path is not None else {}
    dotlist = normalize_overrides(list(overrides))
    try:
        merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist(dotlist))
        data = OmegaConf.to_container(merged, resolve=True)
        unresolved = OmegaConf.to_container(merged, resolve=False)
    except Exception as err:  # omegaconf raises several types for malformed input (RecursionError included)
        raise ConfigError(f"cannot merge overrides {dotlist} into {path}: {str(err)[:2000]}") from err
    # Saved and logged configs keep ${oc.env:NAME} instead of the secret it resolved to (config.redact).
    ENV_SOURCES.update(env_interpolations(unresolved, data))
    source = f"{path or 'defaults'}" + (f" + overrides {dotlist}" if dotlist else "")
    try:
        return root.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(root, err, source)) from None


def save_resolved_config(cfg: BaseModel, output_dir: str | Path) -> Path:
    """Write the fully resolved config next to the run's outputs, for reproducibility; values given as
    ``${oc.env:NAME}`` keep that form and URL credentials are masked (``config.redact``), so no secret is
    written."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / RESOLVED_CONFIG_NAME
    tmp = target.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(public_config(cfg.model_dump(mode="json")), sort_keys=False))
    tmp.replace(target)
    return target
