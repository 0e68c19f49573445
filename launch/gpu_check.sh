#!/usr/bin/env bash
# GPU check for one lent GPU, under 5 minutes: the `gpu`-marked tests (every attention backend x model
# family, packed vs one by one), then packed vs padded training throughput of GPT-2 124M (random init, bf16).
#   bash launch/gpu_check.sh            # uses `python` (or $PYTHON); no network, no data needed
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PACKFSDP_CACHE=${PACKFSDP_CACHE:-$PWD/.cache/packfsdp}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA GPU visible')"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
echo "== gpu-marked tests"
timeout 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit || status=$?
echo "== packed vs padded throughput, GPT-2 124M, bf16"
timeout 110 "$PY" benchmarks/gpu_throughput.py --steps 10 --backends auto flex sdpa_varlen sdpa_block_mask
exit "${status:-0}"
