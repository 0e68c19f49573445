#!/usr/bin/env bash
# The main job, end to end, offline: set up .venv (first run only, with the `chitchat` extra), then compare
# the padded baseline and the packed run of recipe=cpu_chitchat (GPT-2 from its config on the BYU chit-chat
# challenge's human dialogues, a BPE trained on them), each on 2 CPU ranks (FSDP2, fp32), on the same data,
# seed and useful tokens per step (`python -m trainer.tools compare`). Writes report.md, report.json,
# loss.png and throughput.png under outputs/<recipe>/compare-<time>/ and prints the comparison table.
# Extra arguments: Hydra overrides for both runs (e.g. `max_steps=100`) and compare's flags
# (`--variability`, `--publish docs/img`, `--out DIR`; see `python -m trainer.tools compare --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
export PACKFSDP_CACHE=${PACKFSDP_CACHE:-$PWD/.cache/packfsdp}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
NPROC=${NPROC:-2}
RECIPE=${RECIPE:-cpu_chitchat}
.venv/bin/python -m trainer.tools compare recipe="$RECIPE" --nproc "$NPROC" "$@"
