# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv on first use
# and re-installs only when pyproject.toml or constraints.txt changed. Every pip call passes the
# constraints file, so torch stays at the tested 2.13.0 (a CPU wheel here).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet -c constraints.txt

.PHONY: demo lint format test test-cpu test-fast test-gpu gpu-check gpu-wheels bench bench-gpu bench-levers mutation clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The package alone: what `make demo` needs.
$(VENV)/.base: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e .
	touch $@

# The package plus the test tools (pytest, hypothesis, wandb for the offline-logging test), and
# iproute2 for the two-node test where apt-get works (as root); without it that test skips.
$(VENV)/.test: $(VENV)/.base
	$(PIP) -e '.[test]'
	@command -v ip >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq iproute2) \
		>/dev/null 2>&1; } || echo "iproute2 not installed: the two-node test will skip"
	touch $@

# ruff, the formatter and linter whose output is the house style (pyproject.toml's [tool.ruff]).
$(VENV)/.lint: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) ruff
	touch $@

# The package plus Lightning and Accelerate, which the benchmarks compare ddplab with.
$(VENV)/.bench: $(VENV)/.base
	$(PIP) -e '.[bench]'
	touch $@

# cosmic-ray for mutation testing of the core modules (a developer's tool, not part of make test).
$(VENV)/.mutation: $(VENV)/.test
	$(PIP) -e '.[test,mutation]'
	touch $@

# Checks only: the code must already be formatted (`make format` does it) and lint-clean.
LINTED := src tests benchmarks scripts
lint: $(VENV)/.lint
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/python scripts/sizes.py

format: $(VENV)/.lint
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

demo: $(VENV)/.base
	$(BIN)/ddplab run bbbp -n 2 trainer.max_epochs=8

# The suite runs on WORKERS pytest processes (pytest-xdist), each test whole in one of them. Much of
# a multi-process test's time is importing torch (once in the launcher, once in the server its workers
# fork from: launch/fork_server.py), and one test alone keeps 2 cores busy only part of the time (the
# launcher starts before its workers, runs wait on timeouts and restarts): two at a time fill CI's 2 cores. --dist worksteal hands the long tests out as workers free up.
# The sources are compiled to bytecode first: the tests start over a thousand Python processes,
# and where PYTHONDONTWRITEBYTECODE is set each would compile ddplab's modules again (about 50 ms of
# CPU a process, 3 % of a 2-rank run).
WORKERS ?= 2
COMPILED := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q src tests > /dev/null
test: $(VENV)/.test
	$(COMPILED)
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal

# The suite with each test's CPU recorded (scripts/suite_cpu.py), then where it went.
test-cpu: $(VENV)/.test
	$(COMPILED)
	rm -f suite-cpu.jsonl
	PYTHONPATH=scripts $(BIN)/python -m pytest -n $(WORKERS) --dist worksteal -p suite_cpu
	$(BIN)/python scripts/suite_cpu.py suite-cpu.jsonl

test-fast: $(VENV)/.test
	$(COMPILED)
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal -m "not slow"

# The GPU lane: the tests marked gpu, with the machine's GPUs visible to them (they skip without CUDA).
test-gpu: $(VENV)/.test
	DDPLAB_TEST_GPU=1 $(BIN)/python -m pytest -m gpu

# One prepared check for a short lease of GPU time (at most 9 minutes; docs/gpus.md): determinism,
# step ratios, a real out-of-memory, a memory snapshot, the gpu lane. Without CUDA it says what it would run.
gpu-check:
	bash scripts/gpu-check.sh $(GPU_CHECK_ARGS)

# The pure-Python wheels a GPU machine without network lacks, into .gpu-wheels/ to carry there.
gpu-wheels: | $(BIN)/python
	$(BIN)/python -m pip download --quiet --no-deps -c constraints.txt -d .gpu-wheels omegaconf pytest-timeout webdataset braceexpand

# Side-by-side measurements (not tests): results in benchmarks/results/*.json and docs/benchmarks.md.
# (the test extra too: the object-storage benchmark starts moto's S3 server, as the tests do)
bench: $(VENV)/.bench $(VENV)/.test
	$(BIN)/python benchmarks/bench_steps.py --scaling
	$(BIN)/python benchmarks/bench_inprocess.py
	$(BIN)/python benchmarks/bench_startup.py
	$(BIN)/python benchmarks/bench_checkpoint.py
	$(BIN)/python benchmarks/bench_object_storage.py
	$(BIN)/python benchmarks/bench_resume.py
	$(BIN)/python benchmarks/bench_data_resume.py
	$(BIN)/python benchmarks/bench_metrics.py
	$(BIN)/python benchmarks/bench_fsdp.py
	$(BIN)/python benchmarks/bench_live.py
	$(BIN)/python benchmarks/write_report.py

# ddplab, the raw loop, Fabric and Accelerate on one GPU (skips, saying so, without CUDA); rewrites docs/benchmarks.md.
bench-gpu: $(VENV)/.bench
	$(BIN)/python benchmarks/bench_gpu.py
	$(BIN)/python benchmarks/write_report.py

# DDP's levers over a tc-shaped link between two network namespaces (needs root and iproute2).
bench-levers: $(VENV)/.bench
	$(BIN)/python benchmarks/bench_comm_hooks.py
	$(BIN)/python benchmarks/write_report.py

# Mutation testing: each core module's mutants against its own fast tests; scores in docs/testing.md.
mutation: $(VENV)/.mutation
	$(BIN)/python scripts/mutation.py $(MUTATION_ARGS) $(MODULES)

clean:
	rm -rf $(VENV) runs .pytest_cache
