#!/usr/bin/env bash
# One GPU round inside a fixed time budget (a machine lent for a few minutes; `make gpu-round`):
# the compiled tests, then the benchmarks in the order given, each bounded by what is left of
# BUDGET_S and written to benchmarks/results/<gpu>-<date>-<name>.json. Logs, JUnit XML and a
# tarball of the JSON go to OUT_DIR (a few files, so that a remote run returns all of them).
#
#   bash benchmarks/gpu_round.sh OUT_DIR BUDGET_S TEST_S [NAME[:ARGS] ...]
#
# TEST_S: seconds for the compiled in-process suite (0: none), interrupted with SIGINT so that
# pytest still prints the failures so far; PYTEST_ARGS narrows it (test ids, -k). Each NAME is a
# `python -m benchmarks` op, with its options after a colon, "+" for spaces
# ("attention:--seqs+4096,16384"); with several runs of one op, NAME@SUFFIX names the JSON file.
# GPU_ROUND_DRY=1: no GPU, nothing runs; prints the pytest arguments and each benchmark's command
# line as "[dry] ..." (tests/test_benchmarks_gpu_round.py parses them on CPU).
# Measured on one H100 (2026-11-27): set-up 10 s, the whole compiled suite 173 s (14 workers),
# matmul 30 s, attention (8 rows) 70 s, ag_matmul + matmul_rs 60 s, linear_ce 60 s, train > 70 s,
# moe (the former default, with the full DeepSeek-V3 row) > 250 s; its new default is estimated at 60 s.
set -u
OUT_DIR=${1:?usage: gpu_round.sh OUT_DIR BUDGET_S TEST_S [NAME[:ARGS] ...]}
BUDGET_S=${2:?BUDGET_S}
TEST_S=${3:?TEST_S}
shift 3
PY=${GPU_PY:-python3}
DRY=${GPU_ROUND_DRY:-0}
START=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
mkdir -p "$OUT_DIR" benchmarks/results
export PYTHONUNBUFFERED=1

if [ "$DRY" = 1 ]; then
  TAG=dry
  [ "$TEST_S" -gt 0 ] && echo "[dry] pytest $TEST_S s: ${PYTEST_ARGS:-}"
else
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm,temperature.gpu,power.limit --format=csv
    $PY -c "import torch, triton, numpy, platform; p = torch.cuda.get_device_properties(0); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__, 'python', platform.python_version(), 'device', p.name, 'sm', torch.cuda.get_device_capability(), 'SMs', p.multi_processor_count)"
    $PY -c "import fusedpar.kernels" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation --no-index -e .
    $PY -c "import fusedpar.kernels, fusedpar.ops; print('fusedpar imports')"
  } > "$OUT_DIR/env.txt" 2>&1
  cat "$OUT_DIR/env.txt"
  TAG=$($PY -c "import datetime, re, torch; n = torch.cuda.get_device_name(); print(re.sub('[^a-z0-9]+', '-', n.lower()).strip('-') + '-' + datetime.date.today().isoformat())")
fi

if [ "$TEST_S" -gt 0 ] && [ "$DRY" != 1 ]; then
  W=$($PY -c "import os; print(max(1, min(14, (os.cpu_count() or 2) - 2)))")
  # shellcheck disable=SC2086
  FUSEDPAR_TEST_DEVICE=cuda FUSEDPAR_TUNE_CONFIGS=1 timeout -s INT -k 20 "$TEST_S" \
    $PY -m pytest -q -p no:cacheprovider -m "not world" -n "$W" --dist loadgroup --timeout 120 \
    -rfE --tb=short --junitxml="$OUT_DIR/junit.xml" ${PYTEST_ARGS:-} > "$OUT_DIR/test.log" 2>&1
  echo "[round] tests rc=$? after $(( $(date +%s) - START )) s"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT_DIR/test.log" | tail -n 40
fi

for entry in "$@"; do
  spec=${entry%%:*}; opts=""
  [ "$spec" != "$entry" ] && opts=${entry#*:}
  op=${spec%%@*}; name=${spec/@/-}
  t=$(left)
  if [ "$t" -lt 25 ]; then echo "[round] skipped $name: $t s left" | tee -a "$OUT_DIR/bench.log"; continue; fi
  if [ "$DRY" = 1 ]; then echo "[dry] $PY -m benchmarks $op ${opts//+/ } --json benchmarks/results/$TAG-$name.json"; continue; fi
  echo "[round] $name ($t s left)" | tee -a "$OUT_DIR/bench.log"
  # shellcheck disable=SC2086
  timeout -k 10 "$t" $PY -m benchmarks "$op" ${opts//+/ } --json "benchmarks/results/$TAG-$name.json" \
    >> "$OUT_DIR/bench.log" 2>&1
  echo "[round] $name rc=$? at $(( $(date +%s) - START )) s" | tee -a "$OUT_DIR/bench.log"
done
[ "$DRY" = 1 ] && exit 0
tar czf "$OUT_DIR/results.tgz" benchmarks/results/*.json 2>/dev/null
grep -E "^\[round\]|^\|" "$OUT_DIR/bench.log" 2>/dev/null | tail -n 80
