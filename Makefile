# Two entry points: `make demo` (the main job) and `make test` (the suite CI runs).
# Each creates .venv on first use. torch is pinned here, and only here, to the CPU wheel
# that lies on local disk; pyproject.toml declares torch>=2.4 so pip never upgrades it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test unit lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/unbroken demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy src tests

# Three test processes on CI's 2 cores: the end-to-end tests wait on real processes (torchrun's
# grace, hang timeouts, restarts) for part of their time, which a third process fills (the whole
# suite, same box: 982 s with 2, 727 s with 3 on a fast hour; four, tried on 2026-12-03, was not
# shown faster: 863 and 983 s against 912 and 928 s with three, benchmarks/RESULTS.md, and each
# test runs longer beside three others). Each file stays on one process, so a
# module's shared fixtures (a reference run, a moto server) are built once, and the suite runs
# as it must anyway: on a loaded box. TEST_WORKERS=0: one process.
# --no-loadscope-reorder: files go out in collection order (tests/drill, integration, unit), the
# long end-to-end files first and the many short unit files last, so the processes finish
# together; xdist's default sends the files with the most tests first, which left the few-test
# drill files (minutes each) for the end, one process running them while the other idled.
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The lint (mypy's cold run: ~25 s) runs beside the tests rather than before them; its
# report is printed after pytest's, and either one failing fails `make test`.
test: $(STAMP)
	@$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 $(XDIST) tests; tests=$$?; \
	wait $$lint; linted=$$?; cat $(VENV)/lint.log; \
	if [ $$linted -ne 0 ]; then echo "make test: the lint failed (above)"; fi; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# The quick loop while editing: unit tests without the slow ones (fuzzers, end-to-end runs).
unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) -m "not slow" tests/unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
