# Two commands matter: `make run` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
#: `make run` installs only what the gateway needs (no lint, type, test or bench tools).
RUN_STAMP := $(VENV)/.installed-run
CONFIG ?= examples/tidegate.dev.yaml
PORT   ?= 8080

ACCEL  := build/accel
ACCEL_STAMP := $(ACCEL)/.built

.PHONY: run test lint fmt typecheck unit accel accel-test bench clean

# The virtualenv on Python >= 3.11, with an up-to-date pip.
$(BIN)/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tidegate needs Python >= 3.11, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,cluster]'
	@touch $(STAMP)

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	@touch $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/tidegate serve --config $(CONFIG) --host 127.0.0.1 --port $(PORT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck unit accel-test

# The compiled build (see the mypyc hook in pyproject.toml), built from a copy of the sources so
# no extension module lands in src/ (it would shadow the Python there), and unpacked into
# $(ACCEL)/site: PYTHONPATH=$(ACCEL)/site runs it in place of the editable install.
$(ACCEL_STAMP): $(STAMP) pyproject.toml $(shell find src -name '*.py')
	rm -rf $(ACCEL) && mkdir -p $(ACCEL)/tree
	cp -r pyproject.toml README.md LICENSE src $(ACCEL)/tree/
	HATCH_BUILD_HOOKS_ENABLE=1 $(BIN)/python -m pip wheel --quiet --no-deps -w $(ACCEL)/wheel $(ACCEL)/tree
	$(BIN)/python -m pip install --quiet --no-deps --target $(ACCEL)/site $(ACCEL)/wheel/*.whl
	@touch $@

accel: $(ACCEL_STAMP)

# The lab, policy and clock tests again, against the compiled build. Without a C compiler this
# is skipped on a laptop and fails under CI.
accel-test: $(STAMP)
	@if command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory $(ACCEL_STAMP) && \
	  TIDEGATE_EXPECT_COMPILED=1 PYTHONPATH=$(ACCEL)/site $(BIN)/pytest -q -p no:cacheprovider tests/lab tests/policy tests/test_clock.py tests/test_compiled.py; \
	elif [ -n "$$CI" ]; then echo "no C compiler: the compiled build cannot be tested" >&2; exit 1; \
	else echo "skipping the compiled build's tests: no C compiler (cc) on this machine"; fi

bench: $(STAMP)
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done
	@echo "== benchmarks/lab.py (compiled build)"
	@$(MAKE) --no-print-directory $(ACCEL_STAMP) && PYTHONPATH=$(ACCEL)/site $(BIN)/python benchmarks/lab.py

clean:
	rm -rf $(VENV) build .mypy_cache .pytest_cache .ruff_cache .tidegate
