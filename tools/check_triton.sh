#!/usr/bin/env bash
# The Triton copy kernel, byte-exact against torch under Triton's CPU interpreter (TRITON_INTERPRET=1),
# plus its sm_90 compile (16-byte accesses), all without a GPU.
#
# Triton is a ~280 MB wheel: it goes into a pip target of its own (cached between runs), so the default
# CI environment and its test run stay without it. .ci/run calls this after the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=3.9.0
TARGET="${TRITON_TARGET:-${XDG_CACHE_HOME:-$HOME/.cache}/aio_datadist/triton-$VERSION}"
if ! PYTHONPATH="$TARGET" python -c "import triton, sys; sys.exit(triton.__version__ != '$VERSION')" 2>/dev/null; then
    rm -rf "$TARGET"
    python -m pip install -q --disable-pip-version-check --no-deps --target "$TARGET" "triton==$VERSION"
fi

export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
TRITON_INTERPRET=1 python -m pytest -q -m triton tests/test_triton_kernels.py
# The compile check needs the real JIT (the interpreter replaces it); the interpreter check sets its own env.
python -m pytest -q tests/test_device_cpu.py \
    -k "kernel_compiles_for_sm90 or byte_exact_under_the_triton_interpreter"
