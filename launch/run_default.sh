#!/usr/bin/env bash
# The embedded default, end to end, offline: set up .venv (first run only), then compare the padded
# baseline and the packed run of the tiny GPT-2 on the generated DailyDialog-like corpus, each on 2 CPU
# ranks (FSDP2, bf16 mixed precision), on the same data, seed and useful tokens per step
# (`python -m trainer.tools compare`). Writes report.md, report.json, loss.png and throughput.png under
# outputs/<recipe>/compare-<time>/ and prints the comparison table.
# Extra arguments: Hydra overrides for both runs (e.g. `max_steps=100`) and compare's flags
# (`--variability`, `--publish docs/img`, `--out DIR`; see `python -m trainer.tools compare --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
export PACKFSDP_CACHE=${PACKFSDP_CACHE:-$PWD/.cache/packfsdp}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
NPROC=${NPROC:-2}
RECIPE=${RECIPE:-cpu_dailydialog}
.venv/bin/python -m trainer.tools compare recipe="$RECIPE" --nproc "$NPROC" "$@"
