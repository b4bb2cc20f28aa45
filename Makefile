# Two commands do all the set-up on a fresh machine:
#   make run    install, then run the main job (`tidal run` on the default config)
#   make test   install, then lint, type-check and run the test suite
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test setup lint

$(STAMP): pyproject.toml constraints.txt .ci/setup
	bash .ci/setup
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tidal run

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest
