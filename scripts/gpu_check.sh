#!/usr/bin/env bash
# The prepared GPU check: tests/trainer/engine/test_gpu.py's PLAN, group by group, within its BUDGET_S of GPU time (a
# 15-minute device loan less start-up and transfers).
#
#   bash scripts/gpu_check.sh fetch      here, with a package index: optuna and what it needs that a bare CUDA
#                                        image lacks, as wheels for Python 3.12 under .whl/ (ignored)
#   bash scripts/gpu_check.sh --dry-run  anywhere, no GPU needed: the script parses, the test file imports, the
#                                        plan fits the budget; each group's estimate and limit printed
#                                        (tests/test_gpu_check.py)
#   bash scripts/gpu_check.sh [DIR]      there, from the repository root (.whl/ carried along): under DIR (default:
#                                        $OUT, else gpu_logs) plan.txt, clocks.csv, one log per group, and
#                                        tests.tar.gz: every test's own files (its subprocesses' logs, its results)
#
# Order (PLAN): the profile at the realistic shape first, then correctness (the invariance suite on CUDA, activation
# offload included), then the rest. Each group's estimate and limit are printed before it starts, its output streams
# as it runs, and its summary is printed as soon as it ends; every group's summary again at the end.
#
# Limits: each group's limit is its own share of the budget, computed from the plan alone (test_gpu.py's
# group_limits: the estimates scaled to the budget, so the limits never sum past it), and the group runs until its
# deadline, the sum of its and the earlier groups' limits. A group that overruns is interrupted at its own deadline
# (SIGINT: the runner prints what finished and the interrupted test's last log lines; SIGKILL GRACE s later, still
# inside its limit; then whatever of the group is left), so it never takes a later group's share; a group that ends
# early hands its time on.
#
# Files: each test writes under DIR/work/GROUP/ as it runs (test_gpu.py's LOGS_ENV), so a test stopped by its
# limit leaves its output; after each group the text of work/ is packed into tests.tar.gz, because a device loan
# brings back only a few files, none deeper than two folders.
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

# seconds between a group's SIGINT and its SIGKILL, taken from the end of its own limit (tests/test_gpu_check.py
# shortens it to run the loop with a stand-in runner)
GRACE=${GPU_CHECK_GRACE:-5}

if [ "${1:-}" = --dry-run ]; then
    bash -n "$0" || exit 2
    exec "$PY" tests/trainer/engine/test_gpu.py --plan
fi

LOGS="${1:-${OUT:-gpu_logs}}"
mkdir -p "$LOGS" && LOGS=$(cd "$LOGS" && pwd)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
START=$(date +%s)
"$PY" tests/trainer/engine/test_gpu.py --plan | tee "$LOGS/plan.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: the plan does not fit (see above)"; exit 2; }
BUDGET=$(sed -n 's/^total .* of a \([0-9]*\) s budget$/\1/p' "$LOGS/plan.txt")
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'gpus', torch.cuda.device_count())"
# the SM clock and load every 2 s, the whole run: later trials of the first H200 warm job ran up to 1.4x
# faster than earlier ones (clock ramp-up, lazy module loading or library caches: not known yet)
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,memory.used --format=csv -l 2 > "$LOGS/clocks.csv" 2>&1 &
CLOCKS=$!

# the text of every test's files in one archive (checkpoints and saved tensors left out)
pack() {
    (cd "$LOGS" && find work -type f -size -4M ! -name '*.pt' ! -name '*.safetensors' ! -name '*.bin' -print0 \
        | tar -czf tests.tar.gz --null -T -) || echo "gpu_check: packing work/ into tests.tar.gz failed"
}

GROUPS_RUN=()
T0=$(date +%s)  # the deadlines count from here: the set-up above is not any group's
while read -r _ name estimate limit deadline _; do
    at=$(( $(date +%s) - T0 ))
    # until the deadline fixed by the plan: an earlier group's overrun ended at that group's own deadline
    allowed=$(( deadline - at ))
    if [ "$allowed" -le $(( GRACE * 3 )) ]; then
        echo "##### group $name: skipped, ${allowed} s to its deadline at ${deadline} s (estimate ${estimate} s)"
        continue
    fi
    echo "##### group $name: estimate ${estimate} s, limit ${limit} s, ${allowed} s until its deadline at" \
        "${deadline} s, at ${at} s"
    mkdir -p "$LOGS/work/$name"
    GROUPS_RUN+=("$name")
    pgid="$LOGS/work/$name.pgid"
    {
        # timeout makes its own process group (its pid, written here before the exec) and signals all of it
        PPOTUNE_GPU_LOGS="$LOGS/work/$name" bash -c 'echo $$ > "$0"; exec "$@"' "$pgid" \
            timeout -s INT -k "$GRACE" $(( allowed - GRACE )) \
            "$PY" tests/trainer/engine/test_gpu.py --group "$name" < /dev/null
        echo "##### group $name: exit $? at $(( $(date +%s) - T0 )) s"
        # a process of the group that outlived the runner (one that ignores SIGINT) would hold tee's pipe open
        # and stall the next group: nothing of this group runs on
        kill -KILL -- "-$(cat "$pgid")" 2> /dev/null
    } 2>&1 | tee "$LOGS/$name.log"
    pack
done < <(grep '^group ' "$LOGS/plan.txt")
kill "$CLOCKS" 2> /dev/null
# the packed copy is what comes back; the tree itself holds checkpoints and too many files for a loan's return
[ -f "$LOGS/tests.tar.gz" ] && rm -rf "$LOGS/work"
# every group's outcomes together at the end, where a truncated console still shows them
echo "===== gpu_check: every group's summary"
for name in ${GROUPS_RUN[@]+"${GROUPS_RUN[@]}"}; do
    echo "## $name"
    sed -n '/^===== summary/,$p' "$LOGS/$name.log" | tail -n +2
done
echo "gpu_check: done in $(( $(date +%s) - START )) s (groups: $(( $(date +%s) - T0 )) s of a ${BUDGET} s budget)"
