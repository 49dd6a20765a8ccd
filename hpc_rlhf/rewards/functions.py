"""User reward functions, in OpenRLHF's format, loaded from a file path.

A reward file (``reward.reward_func_path``) defines::

    def reward_func(queries, prompts, labels, **kwargs) -> dict:
        # queries: list[str], prompt + response text per sample (special tokens kept)
        # prompts: list[str], the prompt text per sample
        # labels:  list, the dataset label per sample (None without data.label_key)
        return {
            "rewards": tensor or list, one number per sample (the training signal),
            "scores": optional, one number per sample (for filtering/logging; default: rewards),
            "extra_logs": optional {name: one number per sample, or one number}, logged as means,
        }

Keyword arguments the caller offers (e.g. ``responses``) are passed only when the function's
signature accepts them, so a plain ``reward_func(queries, prompts, labels)`` keeps working.
Returning a bare tensor/list (older OpenRLHF files) is read as ``rewards``.

Errors
------
Every problem raises ``RewardFunctionError`` naming the file:

* the file is missing, fails to import, or defines no callable ``reward_func``;
* the output is malformed: not a dict, no ``rewards``, a wrong length, a non-numeric or a
  non-finite value (the message names the key and the first bad sample);
* the function raises. Because a batch failure rarely says which input caused it, the function is
  then called again **once per sample** (in order, stopping at the first failure) and the error
  reports that sample's index, its prompt and the traceback of that per-sample call. If every
  sample succeeds alone, the batch traceback is reported. This re-execution means a function with
  side effects (an external judge, a counter) may see up to B extra calls, only on the failure
  path; pass ``locate_failing_sample=False`` to skip it.
* a call runs longer than ``timeout_s`` (``reward.reward_func_timeout_s``): it runs in a daemon thread,
  which is abandoned, so a hung function can neither hang the run nor keep the process alive at exit.
"""

from __future__ import annotations

import numbers
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hpc_rlhf.utils.user_calls import UserCallTimeout, call_in_thread
from hpc_rlhf.utils.user_code import UserCodeImportError, accepted_kwargs, import_user_file

_PROMPT_CHARS_IN_ERROR = 2000


class RewardFunctionError(RuntimeError):
    """A user reward function could not be loaded, failed, or returned malformed output."""

    def __init__(self, message: str, *, path: str | None = None, sample_index: int | None = None,
                 prompt: str | None = None, traceback_text: str | None = None):
        super().__init__(message)
        self.path = path
        self.sample_index = sample_index
        self.prompt = prompt
        self.traceback_text = traceback_text


@dataclass
class RewardOutput:
    """Normalised reward-function output for a batch of ``B`` samples (all float32, on CPU)."""

    rewards: torch.Tensor  # (B,)
    scores: torch.Tensor  # (B,)
    extra_logs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B,)


def load_reward_func(path: str) -> Callable[..., Any]:
    """Import ``reward_func`` from a Python file; errors name the file."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise RewardFunctionError(f"reward function file {path} does not exist (reward.reward_func_path)", path=path)
    try:
        module = import_user_file(path, "reward")
    except UserCodeImportError as err:
        raise RewardFunctionError(
            f"importing reward function file {path} failed: {err}\n{traceback.format_exc()}",
            path=path, traceback_text=traceback.format_exc(),
        ) from err
    func = getattr(module, "reward_func", None)
    if not callable(func):
        raise RewardFunctionError(f"{path} must define a callable reward_func(queries, prompts, labels)", path=path)
    return func


def _to_float_tensor(value: Any, name: str, batch_size: int | None, path: str) -> torch.Tensor:
    """One float32 number per sample, or an error naming ``path``, ``name`` and the bad sample."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.dtype in (torch.int8, torch.int16, torch.int32, torch.int64,
                                                        torch.uint8, torch.bool):
            tensor = value.detach().to("cpu", torch.float32)
        else:
            raise RewardFunctionError(f"{path}: {name} has dtype {value.dtype}, expected real numbers", path=path)
        if tensor.dim() == 2 and tensor.shape[1] == 1:
            tensor = tensor.squeeze(1)
        if tensor.dim() != 1:
            raise RewardFunctionError(
                f"{path}: {name} must have shape (B,), got {tuple(tensor.shape)}", path=path)
    else:
        if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays
            value = value.tolist()
        if not isinstance(value, (list, tuple)):
            raise RewardFunctionError(
                f"{path}: {name} must be a tensor or a list with one number per sample, got {type(value).__name__}",
                path=path)
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor) and item.numel() == 1:
                continue
            if isinstance(item, bool) or not isinstance(item, numbers.Real):
                raise RewardFunctionError(
                    f"{path}: {name}[{i}] = {item!r:.80} is not a number", path=path, sample_index=i)
        tensor = torch.tensor([float(x) for x in value], dtype=torch.float32)
    if batch_size is not None and tensor.shape[0] != batch_size:
        raise RewardFunctionError(
            f"{path}: {name} has {tensor.shape[0]} values for a batch of {batch_size} samples", path=path)
    bad = (~torch.isfinite(tensor)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise RewardFunctionError(
            f"{path}: {name}[{i}] = {tensor[i].item()} is not finite", path=path, sample_index=i)
    return tensor


def validate_reward_output(output: Any, batch_size: int, path: str = "<reward_func>") -> RewardOutput:
    """Check a reward function's return value and normalise it to ``RewardOutput``."""
    if not isinstance(output, dict):
        if isinstance(output, (torch.Tensor, list, tuple)):
            output = {"rewards": output}
        else:
            raise RewardFunctionError(
                f"{path}: reward_func must return a dict with 'rewards', got {type(output).__name__}", path=path)
    if "rewards" not in output:
        raise RewardFunctionError(f"{path}: reward_func returned keys {sorted(output)} without 'rewards'", path=path)
    rewards = _to_float_tensor(output["rewards"], "rewards", batch_size, path)
    raw_scores = output.get("scores")
    scores = rewards.clone() if raw_scores is None else _to_float_tensor(raw_scores, "scores", batch_size, path)
    extra_logs: dict[str, torch.Tensor] = {}
    raw_logs = output.get("extra_logs") or {}
    if not isinstance(raw_logs, dict):
        raise RewardFunctionError(f"{path}: extra_logs must be a dict, got {type(raw_logs).__name__}", path=path)
    for name, value in raw_logs.items():
        if (isinstance(value, numbers.Real) and not isinstance(value, bool)) or (
                isinstance(value, torch.Tensor) and value.dim() == 0):
            value = [float(value)] * batch_size  # one number for the batch: broadcast
        extra_logs[str(name)] = _to_float_tensor(value, f"extra_logs[{name!r}]", batch_size, path)
    return RewardOutput(rewards=rewards, scores=scores, extra_logs=extra_logs)


def _clip(text: str) -> str:
    if len(text) <= _PROMPT_CHARS_IN_ERROR:
        return text
    return text[:_PROMPT_CHARS_IN_ERROR] + f"... [{len(text) - _PROMPT_CHARS_IN_ERROR} more chars]"


class RewardFunction:
    """A user reward file as a callable returning ``RewardOutput``; see the module docstring."""

    def __init__(self, path: str, locate_failing_sample: bool = True, timeout_s: float | None = 300.0):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.func = load_reward_func(self.path)
        self.locate_failing_sample = locate_failing_sample
        self.timeout_s = timeout_s

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.timeout_s is None:  # in the caller's thread, e.g. for code that relies on signal.alarm
            return self.func(*args, **kwargs)
        try:
            return call_in_thread(self.func, *args, timeout_s=self.timeout_s, what=f"reward_func in {self.path}",
                                  **kwargs)
        except UserCallTimeout as err:
            raise RewardFunctionError(
                f"reward function {self.path} did not return within {self.timeout_s} s on a batch of "
                f"{len(args[0])} samples and was abandoned; make it faster or raise reward.reward_func_timeout_s",
                path=self.path) from err

    def __repr__(self) -> str:
        return f"RewardFunction({self.path!r})"

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any] | None = None,
                 **kwargs: Any) -> RewardOutput:
        batch_size = len(queries)
        if labels is None:
            labels = [None] * batch_size
        sizes = {"queries": len(queries), "prompts": len(prompts), "labels": len(labels)}
        sizes.update({k: len(v) for k, v in kwargs.items() if isinstance(v, (list, tuple))})
        if len(set(sizes.values())) != 1:
            raise ValueError(f"reward inputs must have one entry per sample, got lengths {sizes}")
        kwargs = accepted_kwargs(self.func, kwargs)
        try:
            output = self._call(list(queries), list(prompts), list(labels), **kwargs)
        except RewardFunctionError:
            raise
        except Exception as err:
            raise self._describe_failure(err, queries, prompts, labels, kwargs) from err
        return validate_reward_output(output, batch_size, self.path)

    def _describe_failure(self, err: Exception, queries, prompts, labels, kwargs) -> RewardFunctionError:
        batch_tb = traceback.format_exc()
        index, tb = None, batch_tb
        if self.locate_failing_sample and len(queries) > 1:
            for i in range(len(queries)):
                one = {k: [v[i]] if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
                try:
                    self._call([queries[i]], [prompts[i]], [labels[i]], **one)
                except RewardFunctionError:
                    break  # a timeout while locating: report the batch failure
                except Exception as sample_err:  # noqa: BLE001 - a user reward function may raise anything
                    # chain=False: the batch failure is the context here, and it is reported above.
                    index, tb = i, "".join(traceback.format_exception(
                        type(sample_err), sample_err, sample_err.__traceback__, chain=False))
                    break
        elif len(queries) == 1:
            index = 0
        if index is None:
            prompt = None
            where = f"on a batch of {len(queries)} samples (each sample alone succeeds)"
            detail = ""
        else:
            prompt = prompts[index]
            where = f"on sample {index} of {len(queries)}"
            detail = f"\nfailing prompt:\n{_clip(str(prompt))}\nlabel: {labels[index]!r:.200}"
        message = (f"reward function {self.path} failed {where}: {type(err).__name__}: {err}{detail}"
                   f"\n--- original traceback ---\n{tb}")
        return RewardFunctionError(message, path=self.path, sample_index=index, prompt=prompt, traceback_text=tb)
