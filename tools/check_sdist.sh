#!/usr/bin/env bash
# Fresh-environment check of the source distribution, installed the way a user installs it:
#
#   1. build an sdist from this checkout (python -m build --sdist; `build` goes into a throwaway
#      virtual environment when the Python running this script has none) and check its contents;
#   2. create a clean virtual environment (no system site-packages);
#   3. install torch==2.13.0 into it first (the CPU build, from this machine's local wheel), then the
#      sdist, which compiles the Cython core;
#   4. from a directory outside the checkout: import aio_datadist._core and run
#      `python -m aio_datadist demo`.
#
# Every temporary directory is removed on exit, whatever happens.
# Usage: tools/check_sdist.sh [python]   (default: $PYTHON, else python3)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${1:-${PYTHON:-python3}}"
work="$(mktemp -d "${TMPDIR:-/tmp}/aio_datadist_sdist.XXXXXX")"
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH PYTHONHOME
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS
step() { printf '\n== [%4ds] %s\n' "$((SECONDS - start))" "$*"; }

cd "$work"  # the checkout's own build/ folder would shadow the `build` module
step "building the sdist of $repo"
if "$python" -m build --version >/dev/null 2>&1; then
    builder="$python"
else
    "$python" -m venv "$work/buildenv"
    "$work/buildenv/bin/python" -m pip install -q build
    builder="$work/buildenv/bin/python"
fi
"$builder" -m build --sdist --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
sdist="$(ls "$work"/dist/aio_datadist-*.tar.gz)"
tar -tzf "$sdist" | sed 's|^[^/]*/||' | sort > "$work/contents"
echo "$(basename "$sdist"): $(wc -l < "$work/contents") entries, $(du -k "$sdist" | cut -f1) KiB"

step "checking its contents"
for needed in setup.py pyproject.toml README.md MANIFEST.in \
        aio_datadist/__init__.py aio_datadist/_core.pyx aio_datadist/_sockets.pxi aio_datadist/_core.pxd aio_datadist/_sys.pxd \
        aio_datadist/_core.pyi aio_datadist/py.typed aio_datadist/testing.py aio_datadist/transport/local.py; do
    grep -qx "$needed" "$work/contents" || { echo "missing from the sdist: $needed"; exit 1; }
done
if grep -E '\.(so|cpp|pyc)$' "$work/contents"; then
    echo "build outputs in the sdist (above)"; exit 1
fi
tracked="$(cd "$repo" && git ls-files aio_datadist 2>/dev/null || true)"
for file in $tracked; do
    grep -qx "$file" "$work/contents" || { echo "tracked but missing from the sdist: $file"; exit 1; }
done
echo "build inputs present, no build outputs"

step "creating a clean virtual environment"
"$python" -m venv "$work/venv"
venv="$work/venv/bin/python"
"$venv" - <<'PY'
import sys, sysconfig
assert sys.prefix != sys.base_prefix, "not a virtual environment"
assert not sys.flags.no_site and sysconfig.get_paths()["purelib"].startswith(sys.prefix)
import importlib.util
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("aio_datadist") is None, \
    "the environment sees packages installed elsewhere"
print(sys.version.split()[0], "in", sys.prefix)
PY

step "installing torch==2.13.0 first"
"$venv" -m pip install -q torch==2.13.0
"$venv" -c 'from importlib.metadata import version; v = version("torch"); print("torch", v); assert v.endswith("+cpu"), "not the CPU build: " + v'

step "installing the sdist (compiles the Cython core)"
"$venv" -m pip install -q "$sdist"
"$venv" -c 'from importlib.metadata import version; v = version("torch"); assert v.endswith("+cpu"), "the install replaced torch: " + v'

step "running from outside the checkout"
mkdir "$work/elsewhere"
cd "$work/elsewhere"
"$venv" - "$repo" <<'PY'
import os, sys
import aio_datadist._core as core
import aio_datadist
repo = os.path.realpath(sys.argv[1])
for module in (core, aio_datadist):
    path = os.path.realpath(module.__file__)
    assert path.startswith(os.path.realpath(sys.prefix)), f"{module.__name__} comes from {path}"
    assert not path.startswith(repo + os.sep), f"{module.__name__} comes from the checkout"
print("aio_datadist._core:", core.__file__, core.live_objects())
PY
"$venv" -m aio_datadist demo

step "sdist check OK"
