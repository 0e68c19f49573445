#!/usr/bin/env bash
# The device check for one lent GPU (H200, python3 3.12, torch 2.11, no network), as ONE command under
# 10 minutes; everything it measures lands in OUT_DIR:
#   bash launch/gpu_wheels.sh                          # here, once: the wheels the GPU image lacks -> .whl/
#   bash launch/gpu_check.sh OUT_DIR                   # there: run(command="bash launch/gpu_check.sh $OUT",
#                                                      #        carry=[".whl"], timeout_s=590)
#   bash launch/gpu_check.sh OUT_DIR --dry-run         # here, no GPU: prints the commands, checks the bundle
#                                                      # installs, composes every run's config
# Steps (each with its own time limit, cut to what is left of GPU_CHECK_BUDGET_S; one failing does not stop
# the next): the `gpu`-marked tests (real kernels, packed == one by one; context parallelism and the hybrid
# models' token mixers each a step of their own); a 20-step trainer run per attention
# backend and their losses side by side; packed vs padded throughput of GPT-2 124M and of a random-init
# Qwen2.5-0.5B-shaped model at 16,384 tokens; a parallel.compile=true run with TORCH_LOGS=recompiles.
# OUT_DIR gets at most 8 files (what the device tool brings back): env.txt, summary.txt (each step's status
# and wall time), check.log (every step's output), backend_losses.txt, throughput_gpt2.json,
# throughput_qwen.json. Run directories and per-step logs stay in $GPU_CHECK_WORK (default /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

DRY_RUN=0
OUT_DIR=
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
    *) OUT_DIR=$arg ;;
  esac
done
[[ -n $OUT_DIR ]] || { echo "usage: bash launch/gpu_check.sh OUT_DIR [--dry-run]" >&2; exit 2; }

# The GPU image's python3 holds torch; a dry run here uses the project's .venv (launch/setup_env.sh) when it exists.
if [[ $DRY_RUN == 1 && -z ${PYTHON:-} && -x $REPO/.venv/bin/python ]]; then PY=$REPO/.venv/bin/python; else PY=${PYTHON:-python3}; fi
WHEELS=$REPO/.whl
SITE=${GPU_CHECK_SITE:-/tmp/site}
WORK=${GPU_CHECK_WORK:-/tmp/packfsdp_gpu_check}
BUDGET_S=${GPU_CHECK_BUDGET_S:-560}  # the device tool's limit is 600 s a command: leave room to write up
BACKENDS=(sdpa_varlen torch_varlen flex)  # sdpa_varlen first: the reference the others' losses are held to
TORCHRUN=(-m torch.distributed.run --standalone --nproc_per_node 1 -m trainer.train)  # torchrun, by its module
TRAIN=(recipe=cpu_dailydialog parallel.device=cuda parallel.backend=nccl max_steps=20 model.self_check=true
       logger.progress_bar=false)
BENCH=(benchmarks/gpu_throughput.py --steps 10 --warmup 3)

mkdir -p "$OUT_DIR" "$WORK/logs" "$WORK/runs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
rm -rf "${WORK:?}/runs/"* "$WORK/logs/"*  # a rerun on a warm machine starts clean
: >"$OUT_DIR/summary.txt"
: >"$OUT_DIR/check.log"
export PYTHONPATH=$REPO PACKFSDP_CACHE=$WORK/cache PYTHONUNBUFFERED=1
START=$SECONDS
FAILED=0

HELPER=$WORK/gpu_check_helper.py  # the check's Python parts, run as: "$PY" "$HELPER" NAME ARGS...
cat >"$HELPER" <<'PY'
import json, shlex, subprocess, sys, tempfile
from pathlib import Path


def env(path):
    """Versions the figures depend on."""
    import platform, importlib.metadata as md, torch
    lines = [f"python {platform.python_version()}", f"torch {torch.__version__} (cuda {torch.version.cuda})"]
    for name in ("transformers", "flash-attn", "hydra-core", "omegaconf", "datasets", "pyarrow", "fsspec",
                 "huggingface-hub", "numpy"):
        try:
            lines.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            lines.append(f"{name} absent")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
    lines.append(f"gpu {gpu}")
    Path(path).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def losses(path, *run_dirs):
    """Each run's loss per step side by side, and each one's largest gap to the first run's."""
    from trainer.metrics import read_metrics
    runs = {Path(d).name: {m.step: m.loss for m in read_metrics(Path(d))} for d in run_dirs}
    names = list(runs)
    steps = sorted(set().union(*runs.values())) if runs else []
    rows = ["step " + " ".join(f"{n:>14}" for n in names)]
    rows += [f"{s:>4} " + " ".join(f"{runs[n].get(s, float('nan')):>14.6f}" for n in names) for s in steps]
    for name in names[1:]:
        common = set(runs[name]) & set(runs[names[0]])
        gap = max((abs(runs[name][s] - runs[names[0]][s]) for s in common), default=float("nan"))
        rows.append(f"max |{name} - {names[0]}| over {len(common)} steps: {gap:.3g}")
    Path(path).write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


def wheel_tag(wheel):
    return "-".join(Path(wheel).stem.split("-")[-3:])


def bundle(wheels_dir):
    """The bundle installs as the GPU machine installs it (python 3.12 tags) and imports from there."""
    wheels = sorted(Path(wheels_dir).glob("*.whl"))
    names = [w.name.split("-")[0].lower() for w in wheels]
    assert len(set(names)) == len(names), f"two versions of one package: {names}"
    with tempfile.TemporaryDirectory(prefix="gpu_check_site_") as site:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", site, "--python-version", "3.12", "--implementation", "cp",
                        "--only-binary=:all:", *map(str, wheels)], check=True)
        print(f"bundle: {len(wheels)} wheels install with --no-index --no-deps --target (python 3.12 tags)")
        modules = ["hydra", "omegaconf", "antlr4"]
        py312_only = [w.name for w in wheels if wheel_tag(w) != "py3-none-any"]
        if not py312_only or sys.version_info[:2] == (3, 12):
            modules.append("datasets")
        else:
            print(f"bundle: import of datasets skipped here (python {sys.version.split()[0]}): its requirement "
                  f"{', '.join(py312_only)} is for python 3.12 only")
        code = ("import importlib, sys; site = sys.argv[1]; "
                "bad = [m for m in sys.argv[2:] if not importlib.import_module(m).__file__.startswith(site)]; "
                "sys.exit(f'imported from elsewhere: {bad}' if bad else 0)")
        subprocess.run([sys.executable, "-c", code, site, *modules], check=True, env={"PYTHONPATH": site})
        print(f"bundle: {', '.join(modules)} import from the bundle alone")


def compose(runs_file):
    """Every trainer run's config, composed and validated as ``trainer.train`` would."""
    from trainer.compose import compose_job_config
    for line in Path(runs_file).read_text().splitlines():
        cfg = compose_job_config(shlex.split(line))
        print(f"composed: attention={cfg.model.attention} device={cfg.parallel.device} "
              f"backend={cfg.parallel.backend} compile={cfg.parallel.compile} max_steps={cfg.max_steps} "
              f"self_check={cfg.model.self_check} run_dir={cfg.run_dir}")


def bench_args(*argv):
    """The throughput benchmark accepts these flags (its model choices included)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_throughput", "benchmarks/gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(list(argv))
    print(f"benchmark flags ok: model={args.model} budget={args.budget} backends={args.backends}")


helpers = {f.__name__: f for f in (env, losses, bundle, compose, bench_args)}
helpers[sys.argv[1]](*sys.argv[2:])
PY

record() {  # one summary line: step, status, wall seconds
  printf '%-20s %-14s %5ss\n' "$1" "$2" "$3" | tee -a "$OUT_DIR/summary.txt"
}

step() {  # step NAME LIMIT_S COMMAND...: runs it (or prints it, dry run) with a time limit and a log
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - (SECONDS - START)))
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s): ${*@Q}" | tee -a "$OUT_DIR/check.log"
  if ((DRY_RUN)); then return 0; fi
  if ((limit < 15)); then record "$name" "skipped" 0; FAILED=1; return 0; fi
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/check.log" >"$WORK/logs/$name.log"
  rc=${PIPESTATUS[0]}
  local status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0)) && [[ $status == ok ]] && status="failed($rc)"
  [[ $status == ok ]] || FAILED=1
  record "$name" "$status" $((SECONDS - t0))
}

train_step() {  # train_step NAME LIMIT_S OVERRIDES...: a trainer run into $WORK/runs/NAME, recompiles logged
  local name=$1 limit=$2; shift 2
  local overrides=("${TRAIN[@]}" "$@" "run_dir=$WORK/runs/$name")
  ((DRY_RUN)) && echo "${overrides[*]@Q}" >>"$WORK/compose.txt"
  step "train_$name" "$limit" env TORCH_LOGS=recompiles "$PY" "${TORCHRUN[@]}" "${overrides[@]}"
}

# --- setup: the bundle (hydra-core, omegaconf, antlr4, datasets, ...) and the versions
if ((!DRY_RUN)); then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA GPU visible')" \
    || { echo "(without a GPU: bash launch/gpu_check.sh OUT_DIR --dry-run)" >&2; exit 1; }
fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  if ((DRY_RUN)); then
    "$PY" "$HELPER" bundle "$WHEELS" || { echo "gpu_check: the bundle in $WHEELS does not install" >&2; exit 1; }
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || { echo "gpu_check: installing $WHEELS failed" >&2; exit 1; }
    export PYTHONPATH=$SITE:$PYTHONPATH
  fi
else
  echo "bundle: no wheels in $WHEELS (build them with: bash launch/gpu_wheels.sh); assuming hydra-core," \
       "omegaconf and datasets are installed"
fi
if ((DRY_RUN)); then
  rm -f "$WORK/compose.txt"
  echo "dry run: nothing runs on CUDA; every command the check would run follows"
else
  "$PY" "$HELPER" env "$OUT_DIR/env.txt" || FAILED=1
  "$PY" -c "import flash_attn" 2>/dev/null && BACKENDS+=(flash_attn)
fi

# --- a. real kernels: packed == one by one at real head dims (tests/unit/test_model_families.py)
# (-rA: one line per test, so a step cut at its limit still says which passed)
PYTEST=("$PY" -m pytest -q -rA -m gpu -p no:cacheprovider)
# (a case costs an H200 ~3 s, a flex one ~20-30 s: Inductor compiles per shape; test_model_families.py says which)
step gpu_tests 200 "${PYTEST[@]}" tests/unit --ignore tests/unit/test_context_parallel_gpu.py \
  --ignore tests/unit/test_mixers_gpu.py
# context parallelism: the kernels' bottom-right alignment (seqlen_q < seqlen_k), one rank's CP attention vs
# the full row, bf16
step cp_attention 100 "${PYTEST[@]}" tests/unit/test_context_parallel_gpu.py
# hybrid models' token mixers on CUDA (per example; the real flash-linear-attention with cu_seqlens where it is
# installed and usable)
step mixers 60 "${PYTEST[@]}" tests/unit/test_mixers_gpu.py

# --- b. a 20-step trainer run per backend, their losses side by side, one compiled run
((DRY_RUN)) && echo "(flash_attn joins the backends when it imports there)"
for backend in "${BACKENDS[@]}"; do
  train_step "$backend" 70 "model.attention=$backend"
done
step backend_losses 20 "$PY" "$HELPER" losses "$OUT_DIR/backend_losses.txt" "${BACKENDS[@]/#/$WORK/runs/}"

# --- c. packed vs padded throughput (useful tokens/s, step time, peak memory)
step throughput_gpt2 90 "$PY" "${BENCH[@]}" --model gpt2 --budget 8192 --backends "${BACKENDS[@]}" \
  sdpa_block_mask --json "$OUT_DIR/throughput_gpt2.json"
step throughput_qwen 100 "$PY" "${BENCH[@]}" --model qwen2.5-0.5b --budget 16384 --backends "${BACKENDS[@]}" \
  --json "$OUT_DIR/throughput_qwen.json"

# --- the compiled run last: the slowest (Inductor), so a slow compile cannot starve the measurements above
train_step compile 120 parallel.compile=true

if ((DRY_RUN)); then
  "$PY" "$HELPER" compose "$WORK/compose.txt" || exit 1
  "$PY" "$HELPER" losses "$WORK/backend_losses.txt" "${BACKENDS[@]/#/$WORK/runs/}" >/dev/null || exit 1
  "$PY" "$HELPER" bench_args --model qwen2.5-0.5b --budget 16384 --backends "${BACKENDS[@]}" || exit 1
  "$PY" -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/unit | tail -1
  echo "dry run: ok (outputs would go to $OUT_DIR, runs to $WORK/runs)"
  exit 0
fi
cat "$OUT_DIR/backend_losses.txt" 2>/dev/null  # the figures again on stdout, should the files not come back
grep -h -E '^(NVIDIA|  (packed|padded) )' "$WORK"/logs/throughput_*.log 2>/dev/null
echo "recompiles logged in the compiled run: $(grep -c 'Recompiling' "$WORK/logs/train_compile.log" 2>/dev/null)" \
  | tee -a "$OUT_DIR/summary.txt"
echo "total ${SECONDS}s" | tee -a "$OUT_DIR/summary.txt"
exit "$FAILED"
