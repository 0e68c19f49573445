#!/usr/bin/env bash
# Set up .venv (first run only) and run the test suite on CPU. Extra arguments go to pytest:
#   bash launch/run_tests.sh                 everything (what .ci/run runs)
#   bash launch/run_tests.sh -m "not slow"   the fast lane: in-process tests only, about a minute
# The tests run on PYTEST_WORKERS pytest-xdist workers (default 2; 1: one process): a scope per test file, and
# one per folder whose files share a launch (tests/conftest.py SHARED_LAUNCH_DIRS), so each launch runs once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
export PACKFSDP_CACHE=${PACKFSDP_CACHE:-$PWD/.cache/packfsdp}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
workers=${PYTEST_WORKERS:-2}
parallel=()
if [[ $workers -gt 1 ]]; then
  parallel=(-n "$workers" --dist loadscope)
  # one thread per worker: two workers of two threads on two cores made small in-process tests 25-50x slower
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
exec .venv/bin/python -m pytest -q "${parallel[@]}" "$@"
