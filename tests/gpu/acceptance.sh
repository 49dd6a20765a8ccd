#!/usr/bin/env bash
# GPU acceptance: every tests/gpu test on one GPU, including GRPO colocated on a locally built ~0.5B Llama
# (tests/gpu/test_acceptance_gpu.py), which prints rollout tokens/s, train tokens/s, MFU, state-dict gather
# GB/s and plan's per-GPU estimate against torch.cuda.max_memory_allocated, and writes them as JSON to
# $HPC_RLHF_ACCEPTANCE_DIR (default runs/acceptance).
#
#   bash tests/gpu/acceptance.sh [pytest args ...]            # from anywhere; e.g. -k full_zero3
#
# For a compute node without internet that has only torch + transformers: the wheels in $WHEELHOUSE (default
# ./wheelhouse, built on a login node: DeepSpeed and its small dependencies, the project's own pure-Python
# dependencies, liger-kernel, bitsandbytes) are installed first, without an index and without dependency
# resolution. See docs/gpu.md, "A wheelhouse for a compute node without internet".
# HPC_RLHF_ACCEPTANCE_BUDGET_S bounds the whole run (the tests run in priority order, so a short allocation gets the
# kernel checks and the training runs first); every report is then gathered into one file,
# $HPC_RLHF_ACCEPTANCE_DIR/summary.json, also when the budget cut the run short.
# Without CUDA every test here skips with its reason.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python}"

WHEELHOUSE="${WHEELHOUSE:-wheelhouse}"
if compgen -G "$WHEELHOUSE/*.whl" > /dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps "$WHEELHOUSE"/*.whl
fi
# The project runs from this checkout (python -m pytest puts it first on the path); its imports must resolve.
missing=$("$PYTHON" - <<'PY'
from importlib.util import find_spec
needed = ["pytest", "omegaconf", "pydantic", "yaml", "hostlist", "filelock", "safetensors", "accelerate", "peft",
          "tokenizers", "deepspeed"]
print(" ".join(m for m in needed if find_spec(m) is None))
PY
)
if [[ -n "$missing" ]]; then
    echo "acceptance: not importable: $missing (put their wheels in $WHEELHOUSE; docs/gpu.md)" >&2
    [[ " $missing " == *" pytest "* ]] && exit 2
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
# The quick kernel checks first, then the training runs (the part a short allocation most needs), then the rest.
first=(tests/gpu/test_kernels_gpu.py tests/gpu/test_acceptance_gpu.py tests/gpu/test_deepspeed_gpu.py)
rest=()
for f in tests/gpu/test_*.py; do [[ " ${first[*]} " == *" $f "* ]] || rest+=("$f"); done
export HPC_RLHF_ACCEPTANCE_DIR="${HPC_RLHF_ACCEPTANCE_DIR:-runs/acceptance}"
mkdir -p "$HPC_RLHF_ACCEPTANCE_DIR"
budget=()
[[ -n "${HPC_RLHF_ACCEPTANCE_BUDGET_S:-}" ]] && budget=(timeout --kill-after=15 "$HPC_RLHF_ACCEPTANCE_BUDGET_S")
status=0
"${budget[@]}" "$PYTHON" -m pytest "${first[@]}" "${rest[@]}" -m gpu -rs -s -p no:cacheprovider "$@" || status=$?
"$PYTHON" - <<'PY'
import json, os, pathlib
folder = pathlib.Path(os.environ["HPC_RLHF_ACCEPTANCE_DIR"])
reports = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if p.stem != "summary"}
(folder / "summary.json").write_text(json.dumps(reports, indent=1))
print(f"acceptance: {len(reports)} reports in {folder / 'summary.json'}: {', '.join(reports) or 'none'}")
PY
[[ $status == 124 ]] && echo "acceptance: stopped by HPC_RLHF_ACCEPTANCE_BUDGET_S=$HPC_RLHF_ACCEPTANCE_BUDGET_S" >&2
exit $status
