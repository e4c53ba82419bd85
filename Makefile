# The two set-up commands of the README: `make demo` and `make test`. Both build (or reuse) the environment first.
PY := .venv/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers: a test module's tests stay together, the Slurm tests share one (tests/conftest.py)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: env demo test test-fast test-gpu gpu-wheels check format clean

env:
	@bash tools/bootstrap_env.sh >/dev/null
	@echo "environment ready in .venv; for the README's and docs' commands: source .venv/bin/activate" >&2

demo: env
	$(PY) -m megagate demo

test: env
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) tests

test-fast: env
	$(PY) -m pytest -q $(XDIST) -m "not slow and not slurm" $(PYTEST_ARGS) tests

# The GPU tests on a GPU machine as it comes (python3 with torch and CUDA, no registry: no bootstrap here);
# megatron-core from the machine, else from the carried .whl/ (`make gpu-wheels`), installed under /tmp.
test-gpu:
	GPU_ACCEPTANCE_HARD_LIMIT=650 bash tools/gpu_acceptance.sh runs/test-gpu --only install,preflight,gpu_tests \
		--budget 590 --cap gpu_tests=560

# The wheels tools/gpu_acceptance.sh needs on a GPU machine that lacks them, into a fresh .whl/ (any python3 with
# pip; no bootstrap): prints each wheel and the total size.
gpu-wheels:
	@bash tools/gpu_wheels.sh

# Lint and formatting (ruff, pinned in requirements.txt); CI runs it before the tests.
check: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: env
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf .pytest_cache build *.egg-info
