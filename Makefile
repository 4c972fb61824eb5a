# The two commands: `make train` and `make test`. Each (re)creates .venv when it is missing or
# older than the pinned requirements, then runs. A fresh checkout needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-stamp

.PHONY: train train-long test test-fast lint compare benchmark bench-trl clean

$(STAMP): requirements.txt setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The tests also run the tau2-bench adapter against the real benchmark, real PyTriton servers,
# NeMo-Run and Ray, and build the documentation site: the tau2, serve and launch extras, the
# docs tools and the lint gate's, resolved together with the pins.
$(TEST_STAMP): $(STAMP) requirements-tau2.txt requirements-serve.txt requirements-launch.txt \
		requirements-docs.txt requirements-lint.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt \
		-r requirements-tau2.txt -r requirements-serve.txt -r requirements-launch.txt \
		-r requirements-docs.txt -r requirements-lint.txt
	touch $(TEST_STAMP)

train: $(STAMP)
	$(VENV)/bin/nemo-orch train trainer.resume=true

# The main job's longer recipe (nemo_orch/conf/recipes/main-long.yaml: SFT on demonstrations
# that read the instruction less often, 240 GRPO steps), into runs/main-long.
train-long: $(STAMP)
	$(VENV)/bin/nemo-orch train recipe=main-long trainer.resume=true

# The README's offline comparison: the policy `make train` trained, next to the fixed routers and
# a monolith (a SIMULATED gpt-5, answer-1's simulated model, with the basic search and sandbox,
# served on 127.0.0.1), on the main job's 300 held-out tasks; then the same policy with unseen
# experts and with another price table. Reports: runs/eval/offline{,_unseen,_repriced}/.
ROUTERS = --agent orchestrator --agent fixed:cheapest --agent fixed:strongest --agent random
COMPARE = rollout.policy=runs/tiny-sft/grpo/checkpoints eval.concurrency=64 \
	eval.max_requests_per_endpoint=64
compare: $(STAMP)
	$(VENV)/bin/nemo-orch eval --benchmark offline $(ROUTERS) --agent monolith $(COMPARE) \
		eval.monolith.simulate=answer-1 \
		'eval.monolith.tools=[tools/offline/search.yaml,tools/offline/python_sandbox.yaml]'
	$(VENV)/bin/nemo-orch eval --benchmark offline $(ROUTERS) $(COMPARE) tools=offline_unseen \
		eval.out_dir=runs/eval/offline_unseen
	$(VENV)/bin/nemo-orch eval --benchmark offline $(ROUTERS) $(COMPARE) tools=offline_repriced \
		eval.out_dir=runs/eval/offline_repriced

# The gate before the tests: lint and format (ruff), types (mypy); pyproject.toml configures both.
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow and not dist"

benchmark: $(STAMP)
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/rollout.py
	$(PY) benchmarks/rollout_prefix_cache.py
	$(PY) benchmarks/sandbox.py
	$(PY) benchmarks/toolscale_generator.py

# The GRPO step against TRL's GRPOTrainer at equal work (benchmarks/vs_trl.py), TRL in a
# virtual environment of its own (requirements-bench-trl.txt says why).
TRL_VENV := .venv-trl
$(TRL_VENV)/.installed-stamp: requirements-bench-trl.txt
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		-r requirements-bench-trl.txt
	touch $@

bench-trl: $(STAMP) $(TRL_VENV)/.installed-stamp
	$(PY) benchmarks/vs_trl.py --trl-python $(TRL_VENV)/bin/python --workload arithmetic
	$(PY) benchmarks/vs_trl.py --trl-python $(TRL_VENV)/bin/python --workload orchestrator

clean:
	rm -rf $(VENV) $(TRL_VENV) runs
