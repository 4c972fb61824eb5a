# The two commands: `make train` and `make test`. Each (re)creates .venv when it is missing or
# older than the pinned requirements, then runs. A fresh checkout needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: train test test-fast benchmark clean

$(STAMP): requirements.txt setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/nemo-orch train trainer.resume=true

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not dist"

benchmark: $(STAMP)
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/rollout.py
	$(PY) benchmarks/sandbox.py

clean:
	rm -rf $(VENV) runs
