#!/usr/bin/env bash
# Build (or reuse) .venv-old: the main .venv's packages with the OLDEST transformers pyproject declares
# (its lower bound, ">=5.17" -> transformers==5.17.*, the GPU image's), so CI's old-stack lane tests the
# oldest version we accept. Cheap: no second torch; .venv-old's own site-packages holds only transformers
# (and any dependency whose visible version it rejects), and a .pth file adds .venv's site-packages
# BEHIND it, so an import finds .venv-old's transformers first.
#   bash launch/setup_old_stack.sh     # prints the python to use: .venv-old/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OLD=${VENV_OLD:-.venv-old}
bash launch/setup_env.sh >&2
MAIN_SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LOWER=$(sed -nE 's/^ *"transformers>=([0-9.]+)[,<"].*/\1/p' pyproject.toml)
[[ $LOWER =~ ^[0-9]+\.[0-9]+$ ]] || { echo "packfsdp: cannot read transformers' lower bound (>=X.Y) from pyproject.toml" >&2; exit 1; }
SPEC="transformers==$LOWER.*"

stamp="$OLD/.packfsdp-old-stack"
want="$SPEC $(cat .venv/.packfsdp-installed | sha256sum | cut -c1-16) $MAIN_SITE"
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then echo "$OLD/bin/python"; exit 0; fi
echo "packfsdp: building $OLD ($SPEC over .venv's packages); log in $OLD/install.log" >&2
rm -rf "$OLD"
.venv/bin/python -m venv --without-pip "$OLD"  # the same interpreter as .venv; pip runs from .venv below
OLD_SITE=$("$OLD/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path): .venv's own .pth files (the editable packfsdp install) are read too.
echo "import site; site.addsitedir('$MAIN_SITE')" >"$OLD_SITE/zz_packfsdp_main_venv.pth"
log="$OLD/install.log"
added=
pip_old() { .venv/bin/python -m pip --python "$OLD/bin/python" install --no-deps --no-warn-conflicts "$@"; }
check_deps() {  # requirements of what .venv-old holds that the visible packages fail, as pip specs
  "$OLD/bin/python" - "$OLD_SITE" <<'PY'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
for dist in md.distributions(path=[sys.argv[1]]):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            ok = req.specifier.contains(md.version(req.name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
        if not ok:
            print(str(req).replace(" ", ""))
PY
}
if ! {
  pip_old "$SPEC" &&
  for round in 1 2 3; do  # each dependency installed may ask for others
    missing=$(check_deps) || break
    [[ -z $missing ]] && break
    added="${added:+$added }$missing"
    pip_old $missing || break
  done &&
  missing=$(check_deps) && [[ -z $missing ]]
} >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "packfsdp: building $OLD failed (${missing:+unmet: $missing; }full log in $log)" >&2
  exit 1
fi
got=$("$OLD/bin/python" -c 'import transformers, os; print(transformers.__version__, os.path.dirname(transformers.__file__))')
case $got in
  "$LOWER".*" $REPO/$OLD/"*) ;;
  *) echo "packfsdp: $OLD imports transformers $got, not $SPEC from $OLD" >&2; exit 1 ;;
esac
echo "$want" >"$stamp"
echo "packfsdp: $OLD ready: transformers ${got%% *}${added:+, with $added}" >&2
echo "$OLD/bin/python"
