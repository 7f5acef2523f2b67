#!/bin/bash
# What a session lent a GPU machine runs there, in one call (issue 19's checks, then issue 16's rows on 16 cores):
#     bash benchmarks/gpu_session.sh [BUDGET_SECONDS]
# The machine has no network: the packages it lacks travel as wheels in .whl/ (git-excluded), fetched here first:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl dask distributed zarr numcodecs donfig crc32c xxhash zstandard cloudpickle toolz partd locket \
#         fsspec msgpack sortedcontainers tblib zict tornado psutil click jinja2 markupsafe pyyaml \
#         mpi4py mpich hypothesis attrs pytest-timeout tqdm packaging typing_extensions
#     (and pure-Python wheels with --python-version 3.12 only; check each one's Requires-Dist)
# then the tool's call: carry [".whl"], timeout_s about 560, command "bash benchmarks/gpu_session.sh 540".
# Each step prints as it goes and has its own limit, so a step cut short keeps what the others printed.
BUDGET=${1:-540}
START=$(date +%s)
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "native extension not built: the pure-Python path runs"
OUT=${OUT:-/tmp}

step() {  # step LIMIT COMMAND...: within LIMIT seconds and what is left of the budget
  local lim=$1; shift
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 15 )); then echo "=== skipped (budget spent): $*"; return; fi
  (( lim > left )) && lim=$left
  echo; echo "=== [t=$(( $(date +%s) - START ))s, limit ${lim}s] $*"
  timeout -k 5 "$lim" "$@"
  echo "=== rc=$?"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "$(nproc) cores; python $(python3 -c 'import sys; print(sys.version.split()[0])'); cupy $(python3 -c \
  'import cupy; print(cupy.__version__)' 2>&1 | tail -1)"
step 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_devicehash.py tests/test_gpu_dask.py \
  --junitxml "$OUT/gpu-tests.xml"
step 120 python3 benchmarks/bench_gpu.py --gib 4 --repeat 2
step 90 python3 benchmarks/bench_levels_mpi.py --ranks 8 --group 4 --mib 128 --repeat 3 --levels 1 2
step 90 python3 benchmarks/bench_dask.py --workers 8 --size-mib 4096 --chunk-mib 128 --repeat 2
echo "=== done in $(( $(date +%s) - START ))s"
