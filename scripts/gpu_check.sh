#!/usr/bin/env bash
# The prepared GPU check: tests/trainer/engine/test_gpu.py's PLAN, group by group, within its BUDGET_S of GPU time (a
# 15-minute device loan less start-up and transfers).
#
#   bash scripts/gpu_check.sh fetch      here, with a package index: optuna and what it needs that a bare CUDA
#                                        image lacks, as wheels for Python 3.12 under .whl/ (ignored)
#   bash scripts/gpu_check.sh --dry-run  anywhere, no GPU needed: the script parses, the test file imports, the
#                                        plan fits the budget; each group's estimate printed (tests/test_gpu_check.py)
#   bash scripts/gpu_check.sh [DIR]      there, from the repository root (.whl/ carried along): one log per group
#                                        under DIR (default: $OUT, else gpu_logs)
#
# Order (PLAN): the profile at the realistic shape first, then correctness (the invariance suite on CUDA, activation
# offload included), then the rest. Each group's estimate is printed before it starts, its output streams as it
# runs, and its summary is printed as soon as it ends; a group that runs out of time is interrupted (SIGINT: the
# runner prints what finished) and the next group gets what is left of the budget.
set -u
cd "$(dirname "$0")/.."
WHEELS=(optuna==5.0.0 sqlalchemy==2.1.9 alembic==1.20.1 mako colorlog)
PY=${PYTHON:-python3}

if [ "${1:-}" = fetch ]; then
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    exec "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "${WHEELS[@]}"
fi

if [ "${1:-}" = --dry-run ]; then
    bash -n "$0" || exit 2
    exec "$PY" tests/trainer/engine/test_gpu.py --plan
fi

LOGS="${1:-${OUT:-gpu_logs}}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
T0=$(date +%s)
"$PY" tests/trainer/engine/test_gpu.py --plan | tee "$LOGS/plan.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: the plan does not fit (see above)"; exit 2; }
BUDGET=$(sed -n 's/^total [0-9]* s of a \([0-9]*\) s budget$/\1/p' "$LOGS/plan.txt")
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'gpus', torch.cuda.device_count())"
# the SM clock and load every 2 s, the whole run: later trials of the first H200 warm job ran up to 1.4x
# faster than earlier ones (clock ramp-up, lazy module loading or library caches: not known yet)
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,memory.used --format=csv -l 2 > "$LOGS/clocks.csv" 2>&1 &
CLOCKS=$!

while read -r _ name estimate _; do
    left=$(( BUDGET - ($(date +%s) - T0) ))
    limit=$(( estimate * 3 / 2 < left ? estimate * 3 / 2 : left ))
    if [ "$limit" -le 10 ]; then
        echo "##### group $name: skipped, ${left} s of the budget left (estimate ${estimate} s)"
        continue
    fi
    echo "##### group $name: estimate ${estimate} s, limit ${limit} s, at $(( $(date +%s) - T0 )) s"
    # SIGINT first (the runner prints what finished), then SIGKILL 15 s later
    timeout -s INT -k 15 "$limit" "$PY" tests/trainer/engine/test_gpu.py --group "$name" < /dev/null 2>&1 | tee "$LOGS/$name.log"
    echo "##### group $name: exit ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
    sed -n '/^===== summary/,$p' "$LOGS/$name.log"
done < <(grep '^group ' "$LOGS/plan.txt")
kill "$CLOCKS" 2> /dev/null
echo "gpu_check: done in $(( $(date +%s) - T0 )) s"
