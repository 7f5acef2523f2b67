#!/bin/bash
# The benchmarks behind the speed targets of issues 15 and 16, in order of priority, each within a time
# limit, on a machine with cores to spare (ideally 16 or more), all output also in LOG:
#     bash benchmarks/issue_targets.sh [LOG] [BUDGET_SECONDS] [MIB_PER_RANK]
# Each step prints as it goes (the MPI levels one invocation per level), so a step cut by its limit, or
# the whole run cut by the budget, keeps what the earlier ones printed. Run from the repository root in
# an environment with ftidask installed ('.[all]'; torch and h5py for the peers' rows).
LOG=${1:-/tmp/ftidask-issue-targets.log}; BUDGET=${2:-560}; MIB=${3:-128}
START=$(date +%s)
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
CORES=$(nproc); RANKS=$(( CORES >= 16 ? 8 : (CORES >= 8 ? 4 : 2) )); GROUP=$(( RANKS >= 4 ? 4 : 2 ))
WORKERS=$(( CORES >= 16 ? 8 : CORES ))

step() {  # step LIMIT COMMAND...: run it within LIMIT seconds and what is left of the budget
  local lim=$1; shift
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "=== skipped (budget spent): $*"; return; fi
  (( lim > left )) && lim=$left
  echo; echo "=== [t=$(( $(date +%s) - START ))s, limit ${lim}s] $*"
  timeout -k 5 "$lim" "$@"
  echo "=== rc=$?"
}

echo "$(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB, kernel $(uname -r); $RANKS MPI ranks in groups of $GROUP"
cd "$(dirname "$0")" || exit 1
# The repository's virtual environment first (README's set-up), where python3 alone may lack ftidask
[ -x ../.venv/bin/python3 ] && export PATH="$PWD/../.venv/bin:$PATH"
# The targets still open first (issue 15: L2-L4 blocked time = L1's over MPI, and whether a pause after each
# commit, which lets the previous checkpoint's deletion finish, changes it; the 4 GiB copy/torch rows; issue 16:
# L2 after the durability fix), then the rest.
step 60 python3 bench_levels_mpi.py --ranks "$RANKS" --group "$GROUP" --mib "$MIB" --async --repeat 5
step 60 python3 bench_levels_mpi.py --ranks "$RANKS" --group "$GROUP" --mib "$MIB" --async --repeat 5 --pause 1
step 60 python3 bench_levels_mpi.py --ranks "$RANKS" --group "$GROUP" --mib "$MIB" --repeat 3 --levels 2
step 120 python3 bench_async.py --gib 4 --repeat 2
for level in 1 3 4; do
  step 60 python3 bench_levels_mpi.py --ranks "$RANKS" --group "$GROUP" --mib "$MIB" --repeat 3 --levels "$level"
done
step 70 python3 bench_l1.py --size-mib 4096 --repeat 3
step 90 python3 bench_dask.py --workers "$WORKERS" --size-mib 4096 --chunk-mib 128 --repeat 2
step 45 python3 bench_erasure.py --size-mib 32 --repeat 3
step 25 python3 bench_erasure.py --size-mib 32 --repeat 3 --isa avx2
step 70 python3 bench_async.py --gib 1 --repeat 3
step 90 python3 bench_peers.py --size-mib 2048 --repeat 1
echo "=== done in $(( $(date +%s) - START ))s"
