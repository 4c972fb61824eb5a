# The two commands: `make train` and `make test`. Each (re)creates .venv when it is missing or
# older than the pinned requirements, then runs. A fresh checkout needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.tau2-stamp

.PHONY: train test test-fast benchmark clean

$(STAMP): requirements.txt setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The tests also run the tau2-bench adapter against the real benchmark: the tau2 extra, resolved
# together with the pins.
$(TEST_STAMP): $(STAMP) requirements-tau2.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt \
		-r requirements-tau2.txt
	touch $(TEST_STAMP)

train: $(STAMP)
	$(VENV)/bin/nemo-orch train trainer.resume=true

test: $(TEST_STAMP)
	$(PY) -m pytest -q

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow and not dist"

benchmark: $(STAMP)
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/rollout.py
	$(PY) benchmarks/sandbox.py
	$(PY) benchmarks/toolscale_generator.py

clean:
	rm -rf $(VENV) runs
