# Two commands do all set-up on a fresh machine by themselves:
#   make demo   the main job: trains a small Transformer on real text (the Python standard library's
#               sources) with tensor + sequence + expert parallelism, validation, checkpoints
#               (4 gloo processes under the Triton interpreter without GPUs; NCCL with 4-8 GPUs)
#   make test   the test suite (Triton interpreter + gloo on a CPU machine, compiled on a GPU machine)
# Both create .venv on first use. Where torch is already installed system-wide (the GPU machines),
# the venv sees it; otherwise torch==2.13.0 is installed first, which resolves to the CPU build on
# the CPU machines, so the test set-up never pulls CUDA wheels.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fusedpar-installed
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_NPROC ?= 4
DEMO_ARGS ?=

.PHONY: test demo bench clean gpu-check gpu-setup gpu-env gpu-test gpu-bench-kernels gpu-bench-comm gpu-bench-moe gpu-train gpu-report gpu-round

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x "$(PY)" ]; then \
	  if $(PYTHON) -c "import torch, triton" >/dev/null 2>&1; then \
	    echo "[setup] using the system torch/triton"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi; \
	if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "[setup] installing $(TORCH_PIN)"; $(PY) -m pip install -q "$(TORCH_PIN)"; \
	fi; \
	$(PY) -m pip install -q -e ".[test]"; \
	touch $(STAMP)

# two pytest-xdist workers (CI has 2 cores), each test module whole in one worker (its world is
# started once); TEST_WORKERS=0 runs everything in this process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q $$([ "$(TEST_WORKERS)" != 0 ] && echo "-n $(TEST_WORKERS) --dist loadfile") $(PYTEST_ARGS)

# one rank per GPU when there are at least DEMO_NPROC GPUs (at most 8), else DEMO_NPROC CPU ranks
demo: $(STAMP)
	@n=$$($(PY) -c "import torch; g = torch.cuda.device_count(); print(min(g, 8) if g >= $(DEMO_NPROC) else $(DEMO_NPROC))"); \
	echo "[demo] python -m torch.distributed.run --standalone --nproc-per-node $$n -m fusedpar.demo $(DEMO_ARGS)"; \
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc-per-node $$n -m fusedpar.demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# ---------------------------------------------------------------------------------------------
# GPU check (a machine with a CUDA GPU, torch and triton installed, possibly offline): no venv and
# no download; the project is installed into GPU_PY's environment without build isolation.
# Parts, each well under 9 minutes on one H100: gpu-env, gpu-test, gpu-bench-kernels,
# gpu-bench-comm, gpu-bench-moe, gpu-train; gpu-report writes benchmarks/RESULTS.md from the JSON.
GPU_PY ?= python3
GPU_RESULTS ?= benchmarks/results
GPU_TAG = $(shell $(GPU_PY) -c "import datetime, re, torch; n = torch.cuda.get_device_name(); print(re.sub('[^a-z0-9]+', '-', n.lower()).strip('-') + '-' + datetime.date.today().isoformat())")
GPU_BENCH = $(GPU_PY) -m benchmarks

gpu-check: gpu-env gpu-test gpu-bench-kernels gpu-bench-comm gpu-bench-moe gpu-train gpu-report

gpu-setup:
	@$(GPU_PY) -c "import fusedpar.kernels" >/dev/null 2>&1 || $(GPU_PY) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	@mkdir -p $(GPU_RESULTS)

gpu-env: gpu-setup
	@nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
	@$(GPU_PY) -c "import torch, triton, platform; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', platform.python_version(), 'device', torch.cuda.get_device_name(), 'sm', torch.cuda.get_device_capability())"

# the compiled test suite: every in-process test (kernels in fp32/fp16/bf16, persistent/waiting GEMMs,
# the emulated transports); the multi-process worlds are deselected. About 1,300 kernel
# specializations compile: each autotuner tries only its first kept config (FUSEDPAR_TUNE_CONFIGS=1;
# tests/test_tuning.py runs the kept configs of ragged shapes one by one) and pytest-xdist, where
# installed, spreads the tests (and their compiles) over GPU_TEST_WORKERS processes sharing the GPU.
GPU_TEST_WORKERS ?= $(shell $(GPU_PY) -c "import os; print(max(1, min(12, (os.cpu_count() or 2) - 2)))")
gpu-test: gpu-setup
	FUSEDPAR_TEST_DEVICE=cuda FUSEDPAR_TUNE_CONFIGS=1 $(GPU_PY) -m pytest -q -p no:cacheprovider -m "not world" \
	  $$($(GPU_PY) -c "import xdist" >/dev/null 2>&1 && echo "-n $(GPU_TEST_WORKERS) --dist loadgroup") $(PYTEST_ARGS)

gpu-bench-kernels: gpu-setup
	$(GPU_BENCH) ceilings --json $(GPU_RESULTS)/$(GPU_TAG)-ceilings.json
	for e in none bias gelu swiglu; do $(GPU_BENCH) matmul --epilogue $$e --json $(GPU_RESULTS)/$(GPU_TAG)-matmul-$$e.json || exit 1; done
	$(GPU_BENCH) attention --json $(GPU_RESULTS)/$(GPU_TAG)-attention.json
	$(GPU_BENCH) attention_variants --json $(GPU_RESULTS)/$(GPU_TAG)-attention_variants.json
	$(GPU_BENCH) rmsnorm --json $(GPU_RESULTS)/$(GPU_TAG)-rmsnorm.json
	$(GPU_BENCH) varlen_attention --json $(GPU_RESULTS)/$(GPU_TAG)-varlen_attention.json
	$(GPU_BENCH) fp8_matmul --json $(GPU_RESULTS)/$(GPU_TAG)-fp8_matmul.json
	$(GPU_BENCH) linear_ce --json $(GPU_RESULTS)/$(GPU_TAG)-linear_ce.json

gpu-bench-comm: gpu-setup
	for op in ag_matmul matmul_rs persistent_ag persistent_rs ring_attention; do $(GPU_BENCH) $$op --json $(GPU_RESULTS)/$(GPU_TAG)-$$op.json || exit 1; done

gpu-bench-moe: gpu-setup
	$(GPU_BENCH) moe --json $(GPU_RESULTS)/$(GPU_TAG)-moe.json

gpu-train: gpu-setup
	$(GPU_BENCH) train --json $(GPU_RESULTS)/$(GPU_TAG)-train.json

gpu-report:
	$(GPU_PY) -m benchmarks report

# a lease of a few minutes: the compiled tests for GPU_ROUND_TEST_S seconds, then the benchmarks of
# GPU_ROUND_BENCH in order (NAME[@SUFFIX][:ARGS], "+" for spaces), each stopped at what is left of
# GPU_ROUND_BUDGET seconds; logs and a tarball of the JSON in GPU_ROUND_OUT (benchmarks/gpu_round.sh)
GPU_ROUND_OUT ?= gpu-round
GPU_ROUND_BUDGET ?= 540
GPU_ROUND_TEST_S ?= 180
# (in order of value: host cost, the GEMM core, the flash backward, the TP ops, then the rest)
GPU_ROUND_BENCH ?= launch launch@stubdrv:--stub-driver matmul@none:--epilogue+none fp8_matmul \
  attention:--seqs+2048,8192+--head-dims+64,128+--compare-loads ag_matmul matmul_rs train:--variant+dense \
  persistent_ag:--no-sweep persistent_rs:--no-sweep linear_ce moe ring_attention varlen_attention attention_variants \
  matmul@swiglu:--epilogue+swiglu+--fp8-out matmul@gelu:--epilogue+gelu matmul@bias:--epilogue+bias \
  fp8_matmul@swiglu:--epilogue+swiglu rmsnorm moe@gptoss:--hidden+2880+--ffn+2880+--experts+32+--top-k+4 \
  ceilings train@moe:--variant+moe
gpu-round: gpu-setup
	GPU_PY=$(GPU_PY) bash benchmarks/gpu_round.sh $(GPU_ROUND_OUT) $(GPU_ROUND_BUDGET) $(GPU_ROUND_TEST_S) $(GPU_ROUND_BENCH)
