#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install packfsdp into it.
# torch is pinned so a CPU machine takes its local CPU wheel; on a GPU machine set TORCH_SPEC
# (e.g. TORCH_SPEC="torch==2.13.0" with a CUDA index) or install torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# dev: pytest and peft; peer: trl (tests/peer/, the DPO check against TRL; ~9 s, pyproject.toml says so);
# chitchat: the main job's corpus (data.source=chitchat; an 8 MB wheel).
EXTRAS=${EXTRAS:-dev,peer,chitchat}

stamp="$VENV/.packfsdp-installed"
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "packfsdp: setting up $VENV ($TORCH_SPEC, extras: $EXTRAS); log in $VENV/install.log"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
log="$VENV/install.log"
if ! { "$VENV/bin/python" -m pip install "$TORCH_SPEC" && "$VENV/bin/python" -m pip install -e ".[$EXTRAS]"; } >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "packfsdp: installation failed; full log in $log" >&2
  exit 1
fi
echo "$want" > "$stamp"
