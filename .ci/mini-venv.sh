#!/usr/bin/env bash
# Create .venv-mini: a virtualenv holding mini-swe-agent (the reference harness of SkyRL
# and rLLM), for the tests that train real harnesses as black boxes inside tidal's
# sandboxes (tests/run/test_workload.py). Idempotent.
#
# It is built on Debian's /usr/bin/python3, which is the sandbox's own python (the default
# image is the host's /usr), so a harness run inside a sandbox needs only this directory
# bound into it (`[agent] mounts`), as a user's own harness venv would be. mini-swe-agent
# pulls litellm and openai; the plain example harness (examples/plain_openai_agent.py)
# runs on the same venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MINI_VENV:-$ROOT/.venv-mini}"
VERSION="${MINI_SWE_AGENT_VERSION:-2.4.6}"
STAMP="$VENV/.tidal-mini-ok"

if [[ -x "$VENV/bin/mini" && -f "$STAMP" ]] && grep -qx "$VERSION" "$STAMP"; then
  echo "mini-swe-agent venv ready: $VENV ($VERSION)"
  exit 0
fi
[[ -x /usr/bin/python3 ]] || { echo "mini-venv: /usr/bin/python3 is missing (.ci/sandbox-deps.sh)" >&2; exit 1; }
if ! /usr/bin/python3 -c "import ensurepip" 2>/dev/null; then  # Debian splits venv out
  if [[ "$(id -u)" -ne 0 ]]; then
    echo "mini-venv: /usr/bin/python3 cannot make venvs (apt-get install python3-venv)" >&2; exit 1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
/usr/bin/python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "mini-swe-agent==$VERSION"
"$VENV/bin/python" -c "import minisweagent, openai; print('mini-swe-agent', minisweagent.__version__)"
echo "$VERSION" > "$STAMP"
echo "mini-swe-agent venv ready: $VENV"
