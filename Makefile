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

.PHONY: test demo bench clean

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

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# one rank per GPU when there are at least DEMO_NPROC GPUs (at most 8), else DEMO_NPROC CPU ranks
demo: $(STAMP)
	@n=$$($(PY) -c "import torch; g = torch.cuda.device_count(); print(min(g, 8) if g >= $(DEMO_NPROC) else $(DEMO_NPROC))"); \
	echo "[demo] python -m torch.distributed.run --standalone --nproc-per-node $$n -m fusedpar.demo $(DEMO_ARGS)"; \
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc-per-node $$n -m fusedpar.demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
