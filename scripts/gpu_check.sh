#!/usr/bin/env bash
# One call on a GPU machine: the CUDA backend's whole check, for the closing note of issue 9.
#
#   bash scripts/gpu_check.sh            # ~3-5 minutes on one H200; no network, no installs
#
# 1. the CPU-side kernel tests (simulator, nvcc compile/spill check) as a sanity check;
# 2. python -m refserve.selfcheck --backend cupy: the GPU equality tests with pytest, then
#    the benchmark table (copy GB/s, fp16 TFLOP/s, paged attention v1/v2 vs torch SDPA,
#    LLM.generate vs transformers, batch-1 vs the weight-streaming floor, greedy tokens);
#    the JSON lands in $OUT (when set, e.g. on the device runner) or the current folder.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import cupy, torch, transformers; print('cupy', cupy.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_kernels_nvcc.py \
    tests/test_kernels_rejection_sim.py 2>&1 | tail -3
timeout 540 python -m refserve.selfcheck --backend cupy --json "$out/selfcheck.json" \
    2>&1 | tee "$out/selfcheck.log"
exit "${PIPESTATUS[0]}"
