# The two set-up commands of the README: `make demo` and `make test`. Both build (or reuse) the environment first.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: env demo test test-fast test-gpu gpu-wheels check format clean

env:
	@bash tools/bootstrap_env.sh >/dev/null

demo: env
	$(PY) -m megagate demo

test: env
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-fast: env
	$(PY) -m pytest -q -m "not slow and not slurm" $(PYTEST_ARGS) tests

test-gpu: env
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

# megatron-core's wheel (the version requirements.txt pins) for tools/gpu_acceptance.sh on a machine without it
gpu-wheels: env
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
		"$$(grep -E '^megatron-core==' requirements.txt | cut -d' ' -f1)"

# Lint and formatting (ruff, pinned in requirements.txt); CI runs it before the tests.
check: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: env
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf .pytest_cache build *.egg-info
