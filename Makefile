# Two commands set everything up on a fresh machine: `make run` and `make test`.
# Virtual environments and the built model are cached under $(MOTOR_CACHE_DIR) (default
# ~/.cache/motorsite), keyed by hashes of the lock files and the model recipe.
PYTHON ?= python3

.PHONY: run test setup bench relock

run:
	$(PYTHON) -m toolchain exec manage.py runstack

# The suite as two pytest sessions at once, tests/integration and the rest (toolchain/suite.py);
# `python3 -m toolchain exec -m pytest` runs it in one.
test:
	$(PYTHON) -m toolchain test

setup:
	$(PYTHON) -m toolchain ensure

bench:
	$(PYTHON) -m toolchain exec bench/first_path.py

# Re-resolve the vLLM environments with the CPU recipe and rewrite requirements/*.lock.
relock:
	$(PYTHON) -m toolchain relock render engine
