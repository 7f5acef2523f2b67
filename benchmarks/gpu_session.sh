#!/bin/bash
# What a session lent a GPU machine runs there, in one call (issue 19's checks, then issue 16's rows on 16 cores):
#     bash benchmarks/gpu_session.sh [BUDGET_SECONDS]
# The machine has no network: the packages it lacks travel as wheels in .whl/ (git-excluded), fetched here first:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl dask distributed zarr numcodecs donfig crc32c xxhash zstandard cloudpickle toolz partd locket \
#         fsspec msgpack sortedcontainers tblib zict tornado psutil click jinja2 markupsafe pyyaml \
#         mpi4py mpich hypothesis attrs pytest-timeout tqdm packaging typing_extensions google-crc32c msgspec
#     (and pure-Python wheels with --python-version 3.12 only; check each one's Requires-Dist)
# then the tool's call: carry [".whl"], timeout_s about 560, command "bash benchmarks/gpu_session.sh 540".
# Each step prints as it goes and has its own limit, so a step cut short keeps what the others printed.
BUDGET=${1:-540}
START=$(date +%s)
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
  # pip --target keeps a wheel's bin/ but drops its lib/ (MPICH's libmpi): that wheel is unpacked by hand instead
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v /mpich-) && export PYTHONPATH=/tmp/site:$PWD
  if ls .whl/mpich-*.whl >/dev/null 2>&1; then
    python3 -m zipfile -e .whl/mpich-*.whl /tmp/mpich && MPICH=$(echo /tmp/mpich/mpich-*.data/data) && chmod -R +x "$MPICH/bin"
    # the image's Open MPI would be found first otherwise, and each rank would run alone
    export PATH=$MPICH/bin:$PATH LD_LIBRARY_PATH=$MPICH/lib:$LD_LIBRARY_PATH MPI4PY_LIBMPI=$MPICH/lib/libmpi.so.12
  fi
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
exec > >(tee -a "$OUT/session.log") 2>&1  # the whole log comes back, also when the call is cut short

mpiexec -n 2 python3 -c "from mpi4py import MPI; print('mpi ok', MPI.COMM_WORLD.rank, MPI.Get_library_version()[:20])" 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "$(nproc) cores; python $(python3 -c 'import sys; print(sys.version.split()[0])'); cupy $(python3 -c \
  'import cupy; print(cupy.__version__)' 2>&1 | tail -1)"
# STEPS picks what runs (default: all): gputests (issue 19's tests), gpumpi (their MPI tests alone), gpubench
# (issue 19's benchmark), then issue 16's rows: codec, levels, l1, dask, wb, direct, reshard and small (the last four
# not by default)
STEPS=${STEPS:-gputests gpubench codec levels l1 dask}
[[ $STEPS == *gpumpi* ]] && step 90 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_gpu.py -k mpi
[[ $STEPS == *gputests* ]] && step 200 python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_gpu.py \
  tests/test_devicehash.py tests/test_gpu_dask.py --junitxml "$OUT/gpu-tests.xml"
[[ $STEPS == *gpubench* ]] && step 150 python3 benchmarks/bench_gpu.py --gib 4 --repeat 2
[[ $STEPS == *codec* ]] && step 40 python3 benchmarks/bench_erasure.py --size-mib 64 --repeat 3
[[ $STEPS == *levels* ]] && step 150 python3 benchmarks/bench_levels_mpi.py --ranks 8 --group 4 --mib 256 --repeat 3
[[ $STEPS == *l1* ]] && step 90 python3 benchmarks/bench_l1.py --size-mib 1024 --arrays 4 --repeat 3
[[ $STEPS == *dask* ]] && step 90 python3 benchmarks/bench_dask.py --workers 8 --size-mib 4096 --chunk-mib 128 --repeat 2
# wb: L1 and L4 with the early write-back off, then on: does it help with eight writers on a disk?
if [[ $STEPS == *wb* ]]; then
  for wb in off on; do
    step 60 python3 benchmarks/bench_levels_mpi.py --ranks 8 --group 4 --mib 256 --repeat 3 --levels 1 4 --writeback $wb
  done
fi
# direct: O_DIRECT against buffered writes with eight writers, then the levels and Dask with direct_io off and on
# (not by default; about 6 minutes)
if [[ $STEPS == *direct* ]]; then
  step 90 python3 benchmarks/bench_direct_io.py --procs 8 --mib 256 --repeat 3
  for d in off on; do
    step 150 python3 benchmarks/bench_levels_mpi.py --ranks 8 --group 4 --mib 256 --repeat 3 --direct-io $d
  done
  for d in off on; do
    step 90 python3 benchmarks/bench_dask.py --workers 8 --size-mib 4096 --chunk-mib 128 --repeat 2 --direct-io $d
  done
fi
# reshard: restarts on another number of ranks (not by default; about 2 minutes)
if [[ $STEPS == *reshard* ]]; then
  for spec in "2 3 512" "4 2 256" "8 4 256" "4 8 256"; do
    set -- $spec
    step 60 python3 benchmarks/bench_reshard.py --write-ranks "$1" --read-ranks "$2" --mib "$3" --repeat 3
  done
fi
# small: the fixed cost of a checkpoint (not by default; about 20 s)
[[ $STEPS == *small* ]] && step 40 python3 benchmarks/bench_small.py --checkpoints 200
[[ $STEPS == *small* ]] && step 60 python3 benchmarks/bench_dask_small.py --workers 8 --chunks 16 --checkpoints 20
echo "=== done in $(( $(date +%s) - START ))s"
