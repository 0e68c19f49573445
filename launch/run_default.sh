#!/usr/bin/env bash
# The embedded default, end to end, offline: set up .venv (first run only), then train the tiny GPT-2 on
# the generated DailyDialog-like corpus on 2 CPU ranks (FSDP2, bf16 mixed precision), packed and then as
# the padded baseline on the same data, and print both runs' useful tokens/s and padding fraction.
# Extra arguments are Hydra overrides for both runs, e.g. `max_steps=100`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
export PACKFSDP_CACHE=${PACKFSDP_CACHE:-$PWD/.cache/packfsdp}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
NPROC=${NPROC:-2}
RECIPE=${RECIPE:-cpu_dailydialog}
stamp=$(date +%Y%m%d-%H%M%S)
for packing in bfd none; do
  .venv/bin/torchrun --standalone --nproc_per_node "$NPROC" -m trainer.train recipe="$RECIPE" \
    packing="$packing" run_dir="outputs/$RECIPE/$stamp-$packing" "$@"
done
.venv/bin/python -m trainer.summarize "outputs/$RECIPE/$stamp-bfd" "outputs/$RECIPE/$stamp-none"
