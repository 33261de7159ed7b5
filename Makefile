# kvray developer entry points. Two commands set everything up on a fresh machine:
#   make serve   # venv + install + `kvray serve` on the built-in demo model
#   make test    # venv + install (+ Debian prometheus) + ruff + the whole test suite
#
# torch: the CPU wheel is the fast path here (TORCH_SPEC). GPU users pick their CUDA build:
#   make install TORCH_SPEC="torch==2.9.1" PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cu128"

VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider

.PHONY: install serve test lint format bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/kvray serve

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# One torch thread per process: tests start Ray actors and servers beside the test process
# on small machines, where OpenMP spin-waiting across processes costs more than it gains.
# Two pytest processes at once (tests/conftest.py, --part): the tests that need no shared
# Ray, their output kept in $(LOCAL_LOG) and shown at the end, beside the tests that share the
# session's one Ray and Serve instance, whose waits (deploys, streams, metrics exports) the
# others fill. Both always run to the end; either failing fails the target.
LOCAL_LOG ?= .pytest-local.log
test: install lint
	bash monitoring/install_prometheus.sh
	status=0; \
	$(PYTEST) --part local tests > $(LOCAL_LOG) 2>&1 & local=$$!; \
	$(PYTEST) --part ray tests || status=1; \
	wait $$local || status=1; \
	echo "== the tests without the shared Ray (they ran beside the ones above): =="; \
	cat $(LOCAL_LOG); \
	exit $$status

bench: install
	$(VENV)/bin/kvray bench throughput --compare
