#!/usr/bin/env bash
# Create .venv-harbor: Harbor's own models (harbor needs Python >= 3.12; tidal's venv is
# 3.11), for the test that validates `tidal ledger export --atif` against harbor's
# `Trajectory` model (tests/ledger/test_atif.py). Only the models are imported, and they
# need pydantic alone: harbor is installed without its service dependencies (litellm,
# supabase, fastmcp...), which the models never import. Idempotent.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HARBOR_VENV:-$ROOT/.venv-harbor}"
VERSION="${HARBOR_VERSION:-0.26.0}"
STAMP="$VENV/.tidal-harbor-ok"

if [[ -x "$VENV/bin/python" && -f "$STAMP" ]] && grep -qx "$VERSION" "$STAMP"; then
  echo "harbor venv ready: $VENV ($VERSION)"
  exit 0
fi
PY=""
for cand in python3.13 python3.12 "$HOME"/.pyenv/versions/3.13*/bin/python3 \
            "$HOME"/.pyenv/versions/3.12*/bin/python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c \
      "import sys, ensurepip; sys.exit(sys.version_info < (3, 12))" 2>/dev/null; then
    PY="$(command -v "$cand")"
    break
  fi
done
[[ -n "$PY" ]] || { echo "harbor-venv: no Python >= 3.12 with venv support found" >&2; exit 1; }
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --no-deps "harbor==$VERSION"
"$VENV/bin/pip" install -q "pydantic>=2.14"
"$VENV/bin/python" -c "from harbor.models.trajectories import Trajectory; \
import importlib.metadata as m; print('harbor', m.version('harbor'))"
echo "$VERSION" > "$STAMP"
echo "harbor venv ready: $VENV"
