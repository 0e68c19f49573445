#!/usr/bin/env bash
# Wheels for the lent GPU machine (python 3.12, x86-64, no network), which lacks some of packfsdp's
# requirements: hydra-core, omegaconf, antlr4-python3-runtime (built here from its sdist: PyPI has no wheel),
# and datasets with the two of its requirements that image lacks (dill, multiprocess). Everything else
# (torch, transformers, numpy, pyarrow, fsspec, huggingface-hub, xxhash, ...) is already there.
#   bash launch/gpu_wheels.sh [DIR]        # DIR defaults to .whl/ (git-ignored); idempotent
# Then launch/gpu_check.sh installs DIR on that machine with `pip install --no-index --no-deps --target`.
# The versions are the ones this venv runs its tests with ($PYTHON, default .venv/bin/python or python3),
# one version per package (two of one package would stop the install there).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
PACKAGES=(hydra-core omegaconf antlr4-python3-runtime datasets dill multiprocess)
SDIST_ONLY=antlr4-python3-runtime
TARGET=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

installed_version() {  # the version $PY has installed, so the GPU runs what the tests here ran
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

have_wheel() {  # a wheel of this package is already in DIR (wheel names spell it with underscores)
  compgen -G "$DIR/${1//-/_}-*.whl" >/dev/null
}

mkdir -p "$DIR"
for package in "${PACKAGES[@]}"; do
  if have_wheel "$package"; then
    echo "have    $(basename "$(compgen -G "$DIR/${package//-/_}-*.whl" | head -1)")"
    continue
  fi
  pin="$package==$(installed_version "$package")"
  echo "fetch   $pin"
  if [[ $package == "$SDIST_ONLY" ]]; then
    "$PY" -m pip wheel -q --no-deps --no-binary :all: -w "$DIR" "$pin"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$DIR" "$pin"
  fi
done
ls -l "$DIR"/*.whl
echo "bundle: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
