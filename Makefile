# Two commands for a newcomer: `make train` and `make test`. Both install what they need.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# CPU machines get this torch before the project is installed, so that pip does not pull the
# multi-GB CUDA build; machines with an NVIDIA GPU keep (or get) the default CUDA build.
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
ARGS ?=
STAMP := .make/setup.stamp

.PHONY: setup train test test-gpu lint bench bench-headline sweep-summary kernels gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@mkdir -p .make
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
		if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
			echo "setup: GPU found, installing the default (CUDA) torch"; $(PIP) install $(TORCH_PIP_ARGS) torch; \
		else \
			echo "setup: no GPU, installing the CPU build $(TORCH_CPU_SPEC)"; $(PIP) install $(TORCH_PIP_ARGS) "$(TORCH_CPU_SPEC)"; \
		fi; \
	fi
	$(PIP) install -q -e ".[dev,eval]"
	@touch $(STAMP)

train: setup
	$(PYTHON) -m sparse_llm.train $(ARGS)

# The CPU suite in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one, with its
# fixtures; files in the order tests/conftest.py sets, those with the most `slow` tests first);
# the 15 slowest tests are listed at the end, so that a new slow one is seen.
TEST_WORKERS ?= 2
test: setup
	$(PYTHON) -m ruff check sparse_llm scripts benchmarks tests
	$(PYTHON) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(ARGS)

test-gpu: setup
	$(PYTHON) -m pytest -q -m gpu $(ARGS)

lint: setup
	$(PYTHON) -m ruff check sparse_llm scripts benchmarks tests
	$(PYTHON) -m ruff format --check sparse_llm scripts benchmarks tests

bench: setup
	$(PYTHON) -m benchmarks.ffn $(ARGS)

# The headline figures in one GPU call (benchmarks/headline.py): dense vs sparse on 1b weights at
# L0 ~30 (training step, peak memory, prefill, decode, the FFN op). MODEL=<run dir> times weights
# made earlier; without it the weights are made first (~4.4 min on an H100), with --quick so that
# all of it fits 10 minutes. Writes headline_<gpu>.json/.md into $OUT (the device tool's folder)
# or benchmarks/results. Like gpu-check, no setup step: a GPU machine has its packages.
bench-headline:
	bash -c 'source scripts/device_env.sh && $(PYTHON) -m benchmarks.headline \
		--out-dir "$(or $(OUT),benchmarks/results)" $(if $(MODEL),--model $(MODEL),--quick) $(ARGS)'

# Summarise an L1 sweep (hydra multirun): make sweep-summary SWEEP=runs/sweeps/<date>
sweep-summary: setup
	$(PYTHON) scripts/summarize_sweep.py $(SWEEP)

# Compile every kernel source (.cu and the .cpp bindings) with the JIT build's flags, no GPU needed.
kernels: setup
	PYTHON=$(PYTHON) bash scripts/compile_kernels.sh

# The GPU checks (scripts/gpu_check.sh, its header lists the parts): by default the kernel tests,
# the memcheck and the FFN benchmarks; ARGS picks parts, e.g. make gpu-check ARGS="whole_run".
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf .make build *.egg-info .pytest_cache .ruff_cache
