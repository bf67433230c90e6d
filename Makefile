# tsbatch: two commands set everything up. `make serve` serves the default model, `make test` runs the suite.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# A CPU build of torch; a plain `torch` would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TF4_SPEC ?= transformers==4.57.6

MODEL_DIR ?=
NAME ?= minilm
TASK ?= embedding
STORE ?= model_store
RUN_DIR ?= $(CURDIR)/.run
INFERENCE ?= http://127.0.0.1:8080
MANAGEMENT ?= http://127.0.0.1:8081
PYTEST_ARGS ?=
# e.g. ARCHIVE_ARGS=--no-tune for a fast build, or --profile FILE taken on the serving machine
ARCHIVE_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SERVE_ENV = TMPDIR=$(RUN_DIR)/tmp TEMP=$(RUN_DIR)/tmp LOG_LOCATION=$(RUN_DIR)/logs METRICS_LOCATION=$(RUN_DIR)/logs PATH=$(CURDIR)/$(VENV)/bin:$$PATH

.PHONY: setup java archive serve stop test test-unit test-transformers4 test-wheel bench-all bench-generate bench-many bench-saturation bench-frontend bench-overload bench bench-warmup bench-warmup-served bench-first-request bench-idle bench-beside bench-spread bench-window bench-omp-pools bench-borrow bench-poll bench-workers gpu-check soak chaos bench-recovery clean help

help:
	@echo "make serve    set up, archive all-MiniLM-L6-v2 as '$(NAME)' and serve it on 127.0.0.1:8080-8082"
	@echo "make stop     stop that torchserve"
	@echo "make archive  build $(STORE)/NAME.mar and $(STORE)/config.properties [MODEL_DIR=… NAME=… TASK=…]"
	@echo "make test     set up and run the whole test suite"
	@echo "make test-wheel  the examples from the wheel installed with its dependencies in a fresh venv (CI runs it)"
	@echo "make bench    tsbatch against TorchServe's stock batching, side by side, one workload (BENCH_ARGS=--workload search|short|long|two-cluster; bench/results/bench-WORKLOAD.*)"
	@echo "make bench-all  make bench on all four workloads, then bench/results/summary.md: every arm side by side, each loss of the shipped archive named"
	@echo "make bench-warmup  first request vs steady state per shape, warmup and compile on/off"
	@echo "make bench-warmup-served  the same through torchserve, the shipped mode's lane threads, warmup on/off"
	@echo "make bench-first-request the first request of each length after READY from outside, JIT C1 (shipped) vs the JVM's default"
	@echo "make bench-idle    one pass after idle pauses of 1-200 ms: how cold a waiting worker gets"
	@echo "make bench-beside  a short and a long pass alone and beside another lane's: what two lanes cost each other"
	@echo "make bench-spread  hundreds of short passes in process: how much a pass varies on this host"
	@echo "make bench-window  per workload: profiles, make bench (b, t, d), profiles again, in the same minutes, then the simulator against it (BENCH_ARGS='--out DIR')"
	@echo "make bench-omp-pools  a lane's two-thread pass with one OpenMP team in the process, and with two"
	@echo "make bench-borrow  borrow_cores off and on, live: lone long requests and the mix at light load (--before PY: a third arm from another checkout)"
	@echo "make bench-poll    poll_ms live: lone long requests (what one return to the frontend costs a pass) and the mix at light load"
	@echo "make bench-workers the built archive with 1, 2 and 3 workers: lone requests, mixed load, logs, idle CPU"
	@echo "make bench-generate the generation engine (--task generation) vs TorchServe batching, the bucketed example and TorchServe continuous batching: TTFT, tokens/s, lost, equal to alone (#37)"
	@echo "make bench-many     32 texts as one request against 32 requests: time, padding, equal vectors"
	@echo "make bench-saturation  where a saturated worker's time goes, against the model's in-process ceiling"
	@echo "make bench-frontend  TorchServe's own settings (Netty threads, GC, access log) under a saturated worker"
	@echo "make bench-overload  the shipped archive past its capacity: 200/503/504 per class (short, long), --before PY side by side (bench/results/overload.*)"
	@echo "make gpu-check  every CUDA path in process on one GPU: warmup, CUDA graphs, out of memory, NVML, dtypes, throughput (bench/results/gpu-DATE.md; GPU_ARGS=--dry-run on the CPU; PYTHON=… for the GPU machine's own python)"
	@echo "make soak     50,000 requests through async mode; frontend memory at start and end"
	@echo "make chaos    worker killed mid-batch and overload at 3x capacity (bench/results/chaos.*)"
	@echo "make bench-recovery  the shipped archive's worker killed under the mix, clients with and without X-Deadline-At: time until answers are in time again (bench/results/recovery.*; BENCH_ARGS=--profile FILE skips profiling)"

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e '.[test]'
	touch $@

# TorchServe's frontend needs a Java runtime (11 or newer); install 17 where none is found.
java:
	@if ! command -v java >/dev/null 2>&1; then \
		echo "installing openjdk-17-jre-headless"; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q openjdk-17-jre-headless; \
	fi

setup: $(VENV)/.installed java

archive: setup
	$(PYTHON) -m tsbatch.archiver archive $(if $(MODEL_DIR),--model-dir "$(MODEL_DIR)") --name $(NAME) --task $(TASK) --out $(STORE) $(ARCHIVE_ARGS)

serve: archive
	@$(MAKE) --no-print-directory stop >/dev/null
	@mkdir -p $(RUN_DIR)/tmp $(RUN_DIR)/logs
	@cd $(RUN_DIR) && $(SERVE_ENV) torchserve --start --ncs --ts-config $(CURDIR)/$(STORE)/config.properties \
		--model-store $(CURDIR)/$(STORE) > $(RUN_DIR)/logs/torchserve-start.log 2>&1 < /dev/null
	@$(PYTHON) -m tsbatch.archiver wait-ready --management $(MANAGEMENT) --name $(NAME) --timeout 600 --log $(RUN_DIR)/logs/model_log.log
	@echo
	@echo "$(NAME) is serving. Try:"
	@echo "  curl -s -X POST $(INFERENCE)/predictions/$(NAME) -H 'Content-Type: text/plain' --data 'A man is eating food.'"
	@echo "Stop it with: make stop"

stop:
	@if [ -x $(PYTHON) ]; then $(PYTHON) -m tsbatch.archiver stop --run-dir $(RUN_DIR); fi

test: setup
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

test-unit: setup
	$(PYTHON) -m pytest -q -m unit $(PYTEST_ARGS)

# tsbatch as a team installs it: the wheel (not editable) and its dependencies from the package
# index in a fresh venv; the examples are archived by that venv's CLI and served by its torchserve.
test-wheel: setup java
	rm -rf dist $(VENV)-wheel
	$(PYTHON) -m pip wheel -q --no-deps --no-build-isolation -w dist .
	$(PY) -m venv $(VENV)-wheel
	$(VENV)-wheel/bin/python -m pip install -q --upgrade pip
	$(VENV)-wheel/bin/python -m pip install -q "$(TORCH_SPEC)" dist/tsbatch-*.whl
	TSBATCH_WHEEL_VENV=$(CURDIR)/$(VENV)-wheel $(PYTHON) -m pytest -q tests/e2e/test_own_model.py tests/e2e/test_generate_served.py

# The handler against a transformers 4.x release, so teams pinned to 4.x keep working.
test-transformers4: java
	[ -x $(VENV)-tf4/bin/python ] || $(PY) -m venv $(VENV)-tf4
	$(VENV)-tf4/bin/python -m pip install -q --upgrade pip
	$(VENV)-tf4/bin/python -m pip install -q "$(TORCH_SPEC)" "$(TF4_SPEC)"
	$(VENV)-tf4/bin/python -m pip install -q -e '.[test]' "$(TF4_SPEC)"
	$(VENV)-tf4/bin/python -c 'import transformers; assert transformers.__version__.startswith("4."), transformers.__version__'
	$(VENV)-tf4/bin/python -m pytest -q tests/unit tests/integration $(PYTEST_ARGS)

$(VENV)/.bench-tools: $(VENV)/.installed
	$(PYTHON) -m pip install -q matplotlib py-spy
	touch $@

bench: setup $(VENV)/.bench-tools
	$(PYTHON) bench/run.py $(BENCH_ARGS)

# every workload in turn, then one summary table with a line for each loss of the shipped archive
bench-all: setup $(VENV)/.bench-tools
	for w in search short long two-cluster; do $(PYTHON) bench/run.py --workload $$w $(BENCH_ARGS) || exit 1; done
	$(PYTHON) bench/summary.py

bench-saturation: setup java $(VENV)/.bench-tools
	$(PYTHON) bench/saturation.py $(BENCH_ARGS)

bench-frontend: setup java
	$(PYTHON) bench/frontend.py $(BENCH_ARGS)

bench-overload: setup java
	$(PYTHON) bench/overload.py $(BENCH_ARGS)

bench-warmup: setup
	$(PYTHON) bench/warmup_bench.py $(BENCH_ARGS)

bench-warmup-served: setup java
	$(PYTHON) bench/warmup_served.py $(BENCH_ARGS)

bench-first-request: setup java
	$(PYTHON) bench/first_request.py $(BENCH_ARGS)

bench-idle: setup
	$(PYTHON) bench/idle_bench.py $(BENCH_ARGS)

bench-beside: setup
	$(PYTHON) bench/beside_bench.py $(BENCH_ARGS)

bench-spread: setup
	$(PYTHON) bench/spread_bench.py $(BENCH_ARGS)

bench-window: setup java $(VENV)/.bench-tools
	$(PYTHON) bench/same_window.py $(BENCH_ARGS)

bench-omp-pools: setup
	$(PYTHON) bench/omp_pools.py $(BENCH_ARGS)

bench-borrow: setup java
	$(PYTHON) bench/borrow_live.py $(BENCH_ARGS)

bench-poll: setup java
	$(PYTHON) bench/poll_live.py $(BENCH_ARGS)

bench-workers: setup
	$(PYTHON) bench/workers.py $(BENCH_ARGS)

bench-generate: setup java
	$(PYTHON) bench/generate.py $(BENCH_ARGS)

bench-many: setup java
	$(PYTHON) bench/many_texts.py $(BENCH_ARGS)

# no setup: the GPU machine brings its own CUDA torch (PYTHON=python3); nothing is fetched
GPU_ARGS ?=
gpu-check:
	$(PYTHON) bench/gpu_check.py $(GPU_ARGS)

soak: setup
	$(PYTHON) bench/soak.py $(BENCH_ARGS)

chaos: setup
	$(PYTHON) bench/chaos.py $(BENCH_ARGS)

bench-recovery: setup java
	$(PYTHON) bench/drills/recovery.py $(BENCH_ARGS)

clean: stop
	rm -rf $(STORE) $(RUN_DIR) .pytest_cache
