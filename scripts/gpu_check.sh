#!/usr/bin/env bash
# The prepared GPU check: tests/trainer/test_gpu.py in timed groups, sized from the first H200 run
# (2026-11-30) and estimates for the realistic-shape profile (not yet run) to end inside one 10-minute command
# of a 15-minute device lease.
#
#   bash scripts/gpu_check.sh fetch    here, with a package index: optuna and what it needs that a bare
#                                      CUDA image lacks, as wheels for Python 3.12 under .whl/ (ignored)
#   bash scripts/gpu_check.sh [DIR]    there, from the repository root (.whl/ carried along): one log per
#                                      group under DIR (default: $OUT, else gpu_logs), then each summary
#
# Order: the timing-sensitive test alone first (issue 24's profiled step at a realistic shape: it replaces the MFU
# of the old 0.5B shape, 16 x 96 tokens, which is launch-bound for any engine; `mfu` still runs it by name), then
# the rest side by side, then a real search (its memory objective is NVML's and must not see other processes),
# last so that the 10-minute command cuts it off rather than anything before it. ~9 min in all.
set -u
cd "$(dirname "$0")/.."
WHEELS=(optuna==5.0.0 sqlalchemy==2.1.9 alembic==1.20.1 mako colorlog)

if [ "${1:-}" = fetch ]; then
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "${WHEELS[@]}"
fi

LOGS="${1:-${OUT:-gpu_logs}}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'gpus', torch.cuda.device_count())"

group() {  # group NAME SECONDS TEST-NAME...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 tests/trainer/test_gpu.py "$@" > "$LOGS/$name.log" 2>&1
    echo "group $name: exit $? at $(( $(date +%s) - T0 )) s"
}
# the SM clock and load every 2 s, the whole run: later trials of the first H200 warm job ran up to 1.4x
# faster than earlier ones (clock ramp-up, lazy module loading or library caches: not known yet)
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,memory.used --format=csv -l 2 > "$LOGS/clocks.csv" 2>&1 &
CLOCKS=$!
group 0_profile 240 realistic_shape nvml
group 3_e2e 150 e2e oom packed vllm &
P3=$!
group 4_offload 150 offload &
P4=$!
group 5_invariance 150 invariance &
P5=$!
wait "$P3" "$P4" "$P5"
group 2_search 120 search
kill "$CLOCKS" 2> /dev/null
for f in "$LOGS"/*.log; do
    echo "##### $f"
    sed -n '/===== summary/,$p' "$f"
done
