"""The configuration reference page, generated from the typed schema so that it cannot drift from the code.

    python -m hpc_rlhf.config.reference            # rewrite docs/reference/configuration.md
    python -m hpc_rlhf.config.reference --check    # exit 1 if the page differs from the schema

Every key of the RL trainer (``RunConfig``) and of the offline trainers (``SupervisedRunConfig`` and each trainer's
loss section) becomes a row: its type, default, allowed values and bounds, its description, and the OpenRLHF flag it
replaces, read from the migration table in ``docs/openrlhf_flags.md``. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.config.supervised import (
    DPOLossConfig,
    KTOLossConfig,
    RMLossConfig,
    SFTLossConfig,
    SupervisedRunConfig,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "configuration.md"
FLAGS_PAGE = ROOT / "docs" / "openrlhf_flags.md"
# The offline trainers share SupervisedRunConfig and differ in their ``loss`` section.
LOSS_SECTIONS: dict[str, type[BaseModel]] = {
    "train_sft": SFTLossConfig, "train_rm": RMLossConfig, "train_dpo": DPOLossConfig,
    "train_kto": KTOLossConfig}


@dataclass(frozen=True)
class KeyDoc:
    """One configuration key as the reference shows it."""

    key: str
    type: str
    default: str
    description: str
    openrlhf: str


def _type_text(annotation: Any) -> str:
    """``int``, ``float >= 0``-style text for an annotation: Literals list their values, unions join with "or"."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [_type_text(a) for a in typing.get_args(annotation) if a is not type(None)]
        optional = type(None) in typing.get_args(annotation)
        return " or ".join(parts) + (" or null" if optional else "")
    if origin in (list, tuple, dict):
        args = ", ".join(_type_text(a) for a in typing.get_args(annotation) if a is not Ellipsis)
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    found = []
    for meta in field.metadata:
        if isinstance(meta, Ge):
            found.append(f">= {meta.ge}")
        elif isinstance(meta, Gt):
            found.append(f"> {meta.gt}")
        elif isinstance(meta, Le):
            found.append(f"<= {meta.le}")
        elif isinstance(meta, Lt):
            found.append(f"< {meta.lt}")
    return ", ".join(found)


def _default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def iter_keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """``(dotted key, field)`` of every leaf key of ``model``, in declaration order."""
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)
        if section is not None:
            yield from iter_keys(section, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def openrlhf_flags(page: Path = FLAGS_PAGE) -> dict[str, list[str]]:
    """key -> the OpenRLHF flags the migration table maps to it (a row's flags and keys, in backticks)."""
    mapping: dict[str, list[str]] = {}
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 2 or not cells[0].startswith("`--"):
            continue
        flags = re.findall(r"`(--[\w.-]+)", cells[0])
        keys = [k.split("=")[0] for k in re.findall(r"`([a-z_]+\.[\w.]+(?:=[^`]*)?)`", cells[1])]
        for key in keys:
            for flag in flags:
                if flag not in mapping.setdefault(key, []):
                    mapping[key].append(flag)
    return mapping


def key_docs(model: type[BaseModel], flags: dict[str, list[str]], prefix: str = "") -> list[KeyDoc]:
    docs = []
    for key, field in iter_keys(model, prefix):
        bounds = _bounds(field)
        type_text = _type_text(field.annotation) + (f" ({bounds})" if bounds else "")
        docs.append(KeyDoc(key, type_text, _default_text(field), " ".join((field.description or "").split()),
                           ", ".join(f"`{f}`" for f in flags.get(key, []))))
    return docs


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _table(docs: list[KeyDoc]) -> list[str]:
    lines = ["| key | type | default | description | OpenRLHF |", "|---|---|---|---|---|"]
    for d in docs:
        lines.append(f"| `{d.key}` | {_escape(d.type)} | {_escape(d.default)} | {_escape(d.description)} | "
                     f"{d.openrlhf} |")
    return lines


def render() -> str:
    """The whole page (Markdown)."""
    flags = openrlhf_flags()
    lines = [
        "# Configuration reference",
        "",
        "Every key a recipe (YAML) or a command-line override (`key=value`) can set, generated from the typed schema",
        "(`hpc_rlhf/config/schema.py`, `hpc_rlhf/config/supervised.py`) by `python -m hpc_rlhf.config.reference`;",
        "a test fails when this page and the schema differ, or when a key has no description. Unknown keys and",
        "wrong types fail when the config loads, before any model does. The OpenRLHF column names the flag a key",
        "replaces ([migration table](../openrlhf_flags.md)).",
        "",
        "## RL trainer",
        "",
        "`python -m hpc_rlhf.cli.train_ppo` (`hpc-rlhf train-ppo`): PPO, REINFORCE++, GRPO, RLOO, agents.",
        "",
    ]
    for name, field in RunConfig.model_fields.items():
        section = _section_model(field.annotation)
        assert section is not None, name  # every top-level field of RunConfig is a section
        lines += [f"### `{name}`", "", *_table(key_docs(section, flags, f"{name}.")), ""]
    lines += ["## Offline trainers", "",
              "`python -m hpc_rlhf.cli.train_sft`, `train_rm`, `train_dpo`, `train_kto`: one trained model on every",
              "rank; they share these sections and differ in `loss`.", ""]
    for name, field in SupervisedRunConfig.model_fields.items():
        section = _section_model(field.annotation)
        if name == "loss" or section is None:
            continue
        lines += [f"### `{name}` (offline)", "", *_table(key_docs(section, flags, f"{name}.")), ""]
    for trainer, loss in LOSS_SECTIONS.items():
        lines += [f"### `loss` of `{trainer}`", "", *_table(key_docs(loss, flags, "loss.")), ""]
    return "\n".join(lines).rstrip() + "\n"


def all_key_docs() -> list[KeyDoc]:
    """Every row of the page (for tests)."""
    flags = openrlhf_flags()
    docs = key_docs(RunConfig, flags)
    docs += [d for d in key_docs(SupervisedRunConfig, flags) if not d.key.startswith("loss.")]
    for loss in LOSS_SECTIONS.values():
        docs += key_docs(loss, flags, "loss.")
    return docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the schema")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python -m hpc_rlhf.config.reference", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
