#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install packfsdp into it.
# torch is pinned so a CPU machine takes its local CPU wheel; on a GPU machine set TORCH_SPEC
# (e.g. TORCH_SPEC="torch==2.13.0" with a CUDA index) or install torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev}

stamp="$VENV/.packfsdp-installed"
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
echo "$want" > "$stamp"
