#!/usr/bin/env bash
# The one script a lent GPU runs: collectives on the GPU, the engine on CUDA (torch attention backend) against
# its CPU result, FlashInfer where it can be installed, throughput; benchmarks/gpu_check.py says what each
# checks. A few minutes in all.
#
# The GPU machine reaches no package registry. Its python3 has a CUDA torch, transformers, safetensors,
# tokenizers, sentencepiece and numpy, not the rest of what the engine imports; a run may carry 64 MiB of
# files in all (the working tree included). So, in two steps:
#
#   benchmarks/gpu_check.sh fetch [--flashinfer]   # here, with PyPI: the missing wheels (cp312, x86-64),
#                                                  # at this checkout's versions, into .cache/gpu_check/wheels
#   benchmarks/gpu_check.sh [gpu_check.py args]    # there, carrying .cache/gpu_check: installs the wheels
#                                                  # into /tmp, then runs benchmarks/gpu_check.py
#
# With the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".cache/gpu_check"], timeout_s=480);
# the report comes back as $OUT/gpu_check.json. A dry run on a machine without a GPU: gpu_check.sh --device cpu.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.cache/gpu_check/wheels
SITE=/tmp/pagedserve-gpu-check-site
# What the engine imports that the GPU machine's image lacks (/work/.library/device/KINDS.md lists what it has).
MISSING="pydantic pydantic-core annotated-types typing-inspection typing-extensions xgrammar jsonschema
jsonschema-specifications referencing rpds-py mistral-common apache-tvm-ffi"
BUDGET_MIB=64
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

pip_download() {  # the GPU machine's interpreter: CPython 3.12 on x86-64 Linux
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"
}

mib() { du -sm "$@" | awk '{s += $1} END {print s}'; }

fetch() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # One version of each, this checkout's: two would stop the install there.
  local pins
  pins=$("$PY" - $MISSING <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
EOF
)
  pip_download "$WHEELS" $pins
  local tree
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{print int($1 / 1048576) + 1}')
  echo "gpu_check fetch: $(ls "$WHEELS" | wc -l) wheels, $(mib "$WHEELS") MiB, beside a working tree of ~$tree MiB"
  if [ "${1:-}" = "--flashinfer" ]; then
    local fi=.cache/gpu_check/flashinfer
    rm -rf "$fi" && mkdir -p "$fi"
    pip_download "$fi" flashinfer-python
    local total=$(( $(mib "$WHEELS") + $(mib "$fi") + tree ))
    if [ "$total" -le "$BUDGET_MIB" ]; then
      mv "$fi"/*.whl "$WHEELS"/ && echo "gpu_check fetch: flashinfer carried ($(ls "$WHEELS" | grep -i flashinfer))"
      echo "  its own dependencies are not fetched: list them with unzip -p $WHEELS/flashinfer*.whl '*/METADATA' | grep ^Requires-Dist"
    else
      echo "gpu_check fetch: flashinfer not carried: $(ls "$fi") is $(mib "$fi") MiB; with the rest, $total MiB of the $BUDGET_MIB MiB a run may carry"
    fi
    rm -rf "$fi"
  fi
}

install() {  # on the GPU machine: the carried wheels, where python3 finds them first
  "$PY" -c "import pydantic, xgrammar, jsonschema, mistral_common" 2>/dev/null && return 0  # all there already
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $PY lacks the engine's dependencies and no wheels were carried: run" \
         "'benchmarks/gpu_check.sh fetch' where PyPI is reachable, and carry .cache/gpu_check" >&2
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
}

if [ "${1:-}" = "fetch" ]; then
  shift
  fetch "$@"
  exit 0
fi
install
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check "$@"
