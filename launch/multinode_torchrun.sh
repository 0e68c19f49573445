#!/usr/bin/env bash
# Multi-node HSDP with torchrun: run this same command on every node (one process per GPU).
#
#   NNODES=2 RDZV_HOST=node0 RUN_ID=myjob bash launch/multinode_torchrun.sh recipe=gpt2_dailydialog
#
# Ranks meet through the c10d rendezvous on RDZV_HOST:RDZV_PORT (any node of the job; no separate store).
# The model is replicated across nodes and sharded inside each (parallel.dp_replicate=NNODES), so the
# all-gathers and reduce-scatters stay on the fast intra-node links and only the gradient all-reduce
# crosses nodes. A rank that dies makes torchrun restart the job on every node (up to MAX_RESTARTS times);
# resume=auto and the run directory keyed by RUN_ID let the new attempt continue from the last checkpoint.
# The run directory (or checkpoint.dir) must be on a filesystem all nodes share.
#
# Environment: NNODES (required), RDZV_HOST (required), RUN_ID (required: the same on every node, unique per
# job), NPROC_PER_NODE (default: gpu = one per visible GPU), RDZV_PORT (29500), MAX_RESTARTS (3),
# TORCHRUN (torchrun), DRY_RUN=1 prints the command instead of running it. Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES to the number of nodes}"
: "${RDZV_HOST:?set RDZV_HOST to a host name of one node of the job}"
: "${RUN_ID:?set RUN_ID to a job id shared by all nodes}"
NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}
RDZV_PORT=${RDZV_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
TORCHRUN=${TORCHRUN:-torchrun}
# Restarted workers must not reuse the agent's TCPStore from the previous attempt.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

cmd=(
  "$TORCHRUN"
  --nnodes "$NNODES"
  --nproc-per-node "$NPROC_PER_NODE"
  --rdzv-backend c10d
  --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT"
  --rdzv-id "$RUN_ID"
  --max-restarts "$MAX_RESTARTS"
  -m trainer.train
  parallel.dp_replicate="$NNODES"
  resume=auto
  "$@"
)
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
