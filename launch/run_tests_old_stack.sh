#!/usr/bin/env bash
# The old-stack lane (what .ci/run runs after the full suite): build or reuse .venv-old (the oldest
# transformers pyproject declares over .venv's packages, launch/setup_old_stack.sh), run the fast lane on it,
# and the GPU check's dry run (the GPU image has that transformers). Extra arguments go to pytest.
#   bash launch/run_tests_old_stack.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/$(bash launch/setup_old_stack.sh)
export PACKFSDP_CACHE=${PACKFSDP_CACHE:-$PWD/.cache/packfsdp}  # verdicts are keyed by the versions: shared safely
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
echo "packfsdp: old-stack lane: $("$PY" -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)')"
"$PY" -m pytest -q -m "not slow" -p no:cacheprovider "$@"
dry=$(mktemp -d)
trap 'rm -rf "$dry"' EXIT
PYTHON=$PY GPU_CHECK_WORK=$dry/work bash launch/gpu_check.sh "$dry/out" --dry-run >"$dry/dry_run.log" 2>&1 \
  || { tail -n 30 "$dry/dry_run.log" >&2; echo "packfsdp: launch/gpu_check.sh --dry-run failed on the old stack" >&2; exit 1; }
tail -n 1 "$dry/dry_run.log"
