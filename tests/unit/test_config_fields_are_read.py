"""Every config key is read by the package: a key that is accepted and silently does nothing cannot be added.

Static, over the AST of ``hpc_rlhf`` outside ``hpc_rlhf/config/``: a field ``f`` of section class ``C`` counts
as read when some code accesses ``.f`` on an expression that is ``C`` by name or by type:

* ``<anything>.<section>.f`` where ``<section>`` is an attribute under which ``C`` sits in a config tree
  (``cfg.algo.gamma``, ``self.cfg.logger.logging_steps``);
* ``v.f`` where ``v`` was bound to such an attribute (``algo = cfg.algo``; ``t, r = cfg.train, cfg.rollout``) or
  is a parameter annotated with ``C`` or one of its bases (``ds_cfg: DeepSpeedConfig``) or named like the
  section (``def build(data: Any)``);
* ``getattr(cfg, role).f`` (a role chosen at run time: any section with a field ``f``);
* a config property (``needs_critic``) read that way counts for the fields it reads itself;
* a module-level function of ``hpc_rlhf/config/`` called outside it (``rollout_engine_kind(cfg.rollout, ...)``)
  counts for the fields it reads on its typed parameters: a decision made once in the config package is a read.

A plain ``.f`` on anything else (``self.normalize`` in the reward server) does not count: that is how the keys
this test was written for went unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel

from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.config.supervised import CONFIG_CLASSES

PACKAGE = Path(__file__).resolve().parents[2] / "hpc_rlhf"
CONFIG_DIR = PACKAGE / "config"
ROOTS = (RunConfig, *CONFIG_CLASSES.values())


def _sections(root: type[BaseModel], path: str = ""):
    """Yield ``(dotted path, attribute name, section class)`` for every section below ``root``."""
    for name, field in root.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield f"{path}{name}", name, annotation
            yield from _sections(annotation, f"{path}{name}.")


def _all_fields():
    """``(dotted key, section class, field name)`` of every leaf, each section class once per root path."""
    seen = set()
    for root in ROOTS:
        for path, _, section in _sections(root):
            for name, field in section.model_fields.items():
                annotation = field.annotation
                if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                    continue
                if (section, name) not in seen:
                    seen.add((section, name))
                    yield f"{path}.{name}", section, name


def _section_classes_by_attr() -> dict[str, set[type]]:
    out: dict[str, set[type]] = {}
    for root in ROOTS:
        for _, attr, section in _sections(root):
            out.setdefault(attr, set()).add(section)
    return out


def _class_by_name() -> dict[str, type]:
    classes = {}
    for root in ROOTS:
        for _, _, section in _sections(root):
            for cls in section.__mro__:
                if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
                    classes[cls.__name__] = cls
    return classes


def _annotation_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {part.strip() for part in node.value.replace("|", " ").split()}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _reads(tree: ast.AST, by_attr: dict[str, set[type]], by_name: dict[str, type]) -> dict[str, set]:
    """Field name -> the section classes (or ``"*"``) it is read on, in one module."""
    aliases: dict[str, set[type]] = {}

    def bind(target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr in by_attr:
            aliases.setdefault(target.id, set()).update(by_attr[value.attr])
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                bind(t, v)

    by_name = dict(by_name)
    for node in ast.walk(tree):  # ``from hpc_rlhf.config.schema import LoraConfig as LoraSettings``
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname and alias.name in by_name:
                    by_name[alias.asname] = by_name[alias.name]
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in [*node.args.args, *node.args.kwonlyargs]:
                classes = {by_name[n] for n in _annotation_names(arg.annotation) if n in by_name}
                classes |= by_attr.get(arg.arg, set())  # ``def build(data: Any)`` takes the data section
                if classes:
                    aliases.setdefault(arg.arg, set()).update(classes)

    reads: dict[str, set] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        receiver = node.value
        if isinstance(receiver, ast.Attribute) and receiver.attr in by_attr:
            reads.setdefault(node.attr, set()).update(by_attr[receiver.attr])
        elif isinstance(receiver, ast.Name) and receiver.id in aliases:
            reads.setdefault(node.attr, set()).update(aliases[receiver.id])
        elif isinstance(receiver, ast.Call) and getattr(receiver.func, "id", None) == "getattr":
            reads.setdefault(node.attr, set()).add("*")
    return reads


def _property_reads() -> dict[tuple[type, str], set[str]]:
    """Config properties -> the ``self.<field>`` names they read (including through nested sections)."""
    out = {}
    for root in ROOTS:
        for cls in {root, *(s for _, _, s in _sections(root))}:
            for name in dir(cls):
                prop = getattr(cls, name, None)
                if isinstance(prop, property):
                    import inspect
                    import textwrap

                    tree = ast.parse(textwrap.dedent(inspect.getsource(prop.fget)))
                    out[(cls, name)] = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return out


def _called_names(tree: ast.AST) -> set[str]:
    """Names of the functions a module calls by plain name (``rollout_engine_kind(...)``)."""
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _config_helpers() -> dict[str, ast.FunctionDef]:
    """Module-level functions of the config package, by name."""
    helpers = {}
    for file in CONFIG_DIR.rglob("*.py"):
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                helpers[node.name] = node
    return helpers


@pytest.fixture(scope="module")
def package_reads() -> dict[str, set]:
    by_attr, by_name = _section_classes_by_attr(), _class_by_name()
    reads: dict[str, set] = {}
    called: set[str] = set()
    for file in PACKAGE.rglob("*.py"):
        if CONFIG_DIR in file.parents:
            continue
        tree = ast.parse(file.read_text())
        called |= _called_names(tree)
        for name, classes in _reads(tree, by_attr, by_name).items():
            reads.setdefault(name, set()).update(classes)
    for name, helper in _config_helpers().items():
        if name in called:
            for field, classes in _reads(helper, by_attr, by_name).items():
                reads.setdefault(field, set()).update(classes)
    return reads


def _is_read(section: type, name: str, reads: dict[str, set]) -> bool:
    on = reads.get(name, set())
    return "*" in on or any(issubclass(section, c) or issubclass(c, section) for c in on if c != "*")


def test_every_config_field_is_read_outside_the_config_package(package_reads):
    reads = {k: set(v) for k, v in package_reads.items()}
    # A property read outside (cfg.algo.needs_critic) reads the fields it uses.
    for (cls, prop), used in _property_reads().items():
        if _is_read(cls, prop, package_reads) or (prop in package_reads and cls in ROOTS):
            for field in used:
                # ``self.<section>.<field>`` inside a root's property: mark the field on that section.
                reads.setdefault(field, set()).add(cls)
                for _, _, section in _sections(cls):
                    reads[field].add(section)
    unread = [key for key, section, name in _all_fields() if not _is_read(section, name, reads)]
    assert not unread, (f"config keys accepted but never read outside hpc_rlhf/config/: {unread}; wire each one "
                        "or remove it so that it fails as an unknown key")


def test_the_check_catches_an_unread_key(package_reads):
    class Probe(BaseModel):
        never_read_anywhere: int = 0

    assert not _is_read(Probe, "never_read_anywhere", package_reads)
    # Attribute access on an unrelated object (the reward server's own flag) is not a read of reward.normalize.
    by_attr, by_name = _section_classes_by_attr(), _class_by_name()
    tree = ast.parse("class S:\n    def f(self):\n        return self.normalize\n")
    assert "normalize" not in _reads(tree, by_attr, by_name)
