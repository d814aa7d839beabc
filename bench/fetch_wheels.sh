#!/usr/bin/env bash
# Download the wheels bench/gpu_suite.sh installs on the GPU machine, which reaches no registry.
# Run on a machine with PyPI, from any directory, BEFORE a device session:
#
#   bash bench/fetch_wheels.sh        # -> bench/wheels/ (gitignored), then `carry: ["bench/wheels"]`
#
# The GPU image (python 3.12, torch 2.11, triton 3.6, transformers 5.17, pytest, numpy, pyyaml,
# safetensors, tqdm, tokenizers, pandas, pyarrow, xxhash, fsspec, anyio, matplotlib) lacks:
#   liger-kernel; speculators and what `import speculators.models.dflash` pulls in (its package
#   __init__ imports every model, their data code, datasets and openai); deepspeed (+ hjson,
#   pydantic). Everything is fetched --no-deps at pinned versions, so the set is known.
# PYVER (default 3.12) must match the GPU machine's python: pydantic-core is a compiled wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=bench/wheels
PYVER=${PYVER:-3.12}
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}  # the deepspeed build below imports torch

WHEELS=(
  liger-kernel==0.8.5
  speculators==0.9.0
  hs-connectors==0.9.0
  datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
  openai==3.57.0 sniffio==1.3.1 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  hjson==3.1.0
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

rm -rf "$DEST"  # one version of each package: two would stop the install on the device
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

# deepspeed publishes only an sdist: build its pure-Python wheel here (ops are JIT-built on use).
if ! "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" deepspeed==0.19.8; then
  echo "fetch_wheels: could not build the deepspeed wheel (needs torch and setuptools here); the GPU suite runs without it" >&2
fi

ls -la "$DEST"
du -sh "$DEST"
