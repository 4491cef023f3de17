# Two commands on a fresh machine: `make demo` and `make test`. Both install what they need.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0

.PHONY: demo test test-fast lint venv redis protos clean

$(BIN)/tandem: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(BIN)/tandem

# Debian's redis-server 7.0 if none is on PATH; the tests start their own instance on a free port.
redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

demo: venv redis
	$(BIN)/tandem run configs/demo.yaml

# Tests run with one BLAS thread: torch's default two stall under load on a shared machine. Two
# pytest workers (pytest-xdist): most of the suite waits on the processes and servers it starts.
test: venv redis lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-fast: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/unit -q -m "not slow"

protos: venv
	$(BIN)/python -m tandem.protos

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
