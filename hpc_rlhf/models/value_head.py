"""What a critic / reward-model checkpoint says about its value head: the head's name, and the reward
statistics the RM trainer stores for normalisation.

OpenRLHF names the head ``value_head`` (``--value_head_prefix``); transformers' sequence classifiers name it
``score``. :func:`hpc_rlhf.models.loading.load_value_model` loads a head of either name into ``score``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from safetensors import safe_open

log = logging.getLogger(__name__)

NORMALIZE_KEYS = ("reward_mean", "reward_std")


class ValueHeadError(ValueError):
    """The checkpoint lacks the value head or the normalisation statistics asked for."""


def checkpoint_tensor_names(model_path: str | Path) -> set[str] | None:
    """Tensor names in the safetensors files of a folder (headers only); None when it holds none."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


def check_value_head(model_path: str | Path, prefix: str, key: str) -> None:
    """Fail unless the checkpoint holds ``<prefix>.weight``, naming the config key ``key`` that chose it.

    A missing head is otherwise initialised at random by ``from_pretrained`` (with a warning only), and a
    reward model's scores would be noise. Folders without safetensors cannot be checked cheaply: a warning.
    """
    names = checkpoint_tensor_names(model_path)
    if names is None:
        log.warning("%s has no safetensors files; cannot verify that the value head %r was loaded", model_path, prefix)
        return
    if f"{prefix}.weight" not in names:
        heads = sorted(n for n in names if n.endswith(".weight") and "." not in n[: -len(".weight")])
        raise ValueHeadError(f"{model_path} holds no value head {prefix}.weight (top-level weights: {heads}); "
                             f"is this a reward model? Set {key} to the name of its head.")


def read_reward_normalization(model_path: str | Path, key: str) -> tuple[float, float]:
    """``(reward_mean, reward_std)`` from the model's ``config.json``; ``key`` is the option that asked for them."""
    config_file = Path(model_path) / "config.json"
    config = json.loads(config_file.read_text())
    missing = [k for k in NORMALIZE_KEYS if config.get(k) is None]
    if missing:
        raise ValueHeadError(
            f"{key} needs {' and '.join(NORMALIZE_KEYS)} in {config_file}; missing {missing}. "
            f"The RM trainer stores them; add them by hand or turn {key} off.")
    mean, std = config["reward_mean"], config["reward_std"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (mean, std)) \
            or std <= 0:
        raise ValueHeadError(f"{config_file}: reward_mean={mean!r} and reward_std={std!r} must be finite numbers "
                             "with reward_std > 0")
    return float(mean), float(std)
