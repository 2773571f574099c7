#!/usr/bin/env bash
# The GPU check, in one command on a CUDA machine (CI has no GPU): the CUDA tests, then the measurements of
# `pcr_rag.bench.device_check` on a random-weight Llama-3-8B. Usage: bash scripts/gpu_check.sh [OUTDIR]
# Writes OUTDIR/env.txt, tests.txt, device.json and device.txt. Needs torch with CUDA, transformers and the
# package's own dependencies importable (PYTHONPATH=. works from the repository root). Each part has its own time
# limit (TEST_LIMIT_S, CHECK_LIMIT_S), so a hang in one still leaves the others' figures.
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'transformers', transformers.__version__)"; nproc; } 2>&1 | tee "$out/env.txt"
# the device-agnostic engine tests on the GPU, plus the CUDA-only ones
# (TESTS overrides the list; PYTEST_ARGS adds options: by default "-n 8" where pytest-xdist is installed, since
# tiny models on a GPU are launch-bound: one process took over 150 s for half of these on an H200)
if [ -z "${PYTEST_ARGS+x}" ] && python3 -c "import xdist" 2>/dev/null; then PYTEST_ARGS="-n 8"; fi
tests=${TESTS:-tests/model/test_cuda.py tests/cache/test_device_tier.py tests/engine/test_fidelity.py
  tests/sched/test_batching.py tests/sched/test_overlap_prefetch.py tests/sched/test_small_dram.py}
# shellcheck disable=SC2086
PCR_RAG_TEST_DEVICE=cuda timeout "${TEST_LIMIT_S:-200}" python3 -m pytest -q -p no:cacheprovider -rfE \
  --timeout 90 --durations 8 ${PYTEST_ARGS:-} $tests 2>&1 | tee "$out/tests.txt" | grep -v '^\.*\s*\[' ; echo "tests rc ${PIPESTATUS[0]}"
timeout "${CHECK_LIMIT_S:-260}" python3 -m pcr_rag.bench.device_check --json "$out/device.json" "${@:2}" \
  2>&1 | tee "$out/device.txt"; echo "device_check rc ${PIPESTATUS[0]}"
