# rayturn — the two set-up commands are `make serve` and `make test`; both
# install what they need into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
export MYPYPATH := .typing

.PHONY: install test lint typecheck pytest protos deploy serve bench clean agents

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH_SPEC)"
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy -p rayturn.engine -p rayturn.kernels -p rayturn.cluster -p rayturn.kvstore -p rayturn.router -p rayturn.prefill -p rayturn.decode -p rayturn.protos -p rayturn.api -p rayturn.replay -m rayturn.messages -m rayturn.registry -m rayturn.settings -m rayturn.native_build -m rayturn.cli

pytest: install
	$(VENV)/bin/pytest -q --durations=25 tests

test: lint typecheck pytest

# Regenerate the gRPC modules from protos/rayturn.proto; tests/protos fails while they are stale.
protos: install
	$(PY) -m rayturn.protos.generate

# Render deploy/kuberay/*.yaml from deploy/kuberay/configs/*.yaml; tests/deploy fails while they are stale.
deploy: install
	for config in deploy/kuberay/configs/*.yaml; do $(VENV)/bin/rayturn deploy render --config $$config --out deploy/kuberay || exit 1; done

serve: install
	$(VENV)/bin/rayturn serve

bench: install
	$(PY) bench/engine_throughput.py --quick
	$(PY) bench/prefix_ttft.py --quick

# The coding-agent CLIs that tests/agents runs against `rayturn serve` (Claude Code, Codex, OpenCode;
# versions pinned in tests/agents/agent_clis.py), installed with npm outside the repo, under
# ${RAYTURN_AGENTS_DIR:-${RAYTURN_CACHE_DIR:-~/.cache/rayturn}/agents}; quick once installed.
agents:
	$(PYTHON) tests/agents/agent_clis.py install

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
