#!/usr/bin/env bash
# The GPU check (issues 15, 30): minizero's GPU path in one command and one summary line,
# under 8 minutes on one H200.
#
#   bash gpu_check.sh          # with CUDA; on a machine without it, the same as --cpu
#   bash gpu_check.sh --cpu    # tiny and CPU-only, under a minute: CI proves it still starts
#
# On one GPU (DESIGN.md §9.11: what the CPU's fakes cannot show; probes in tests/gpu_probe.py):
#  versions     torch, CUDA, NCCL, the GPU (also on a CPU)
#  wait         the host's time in NCCL's Work.wait() with and without a timeout
#  equivalence  test_equivalence.py with every thread rank on the GPU
#  csan         test_equivalence.py with CUDA's sanitizer in every rank and communication thread
#  jitter       test_equivalence.py with random sleeps queued on the streams (not the host),
#  strict       as is and under NCCL's point-to-point rules (strict_p2p; it needs one GPU only)
#  host_reads   tests/test_host_reads.py on CUDA (every blocking copy and synchronize seen)
#  probes       set_sync_debug_mode("warn") counts per phase; offload's bits against stage 0
#               for every optimizer, is_pinned, host bytes against the formula; stage 3's
#               memory against the formula, one step's GPU idle fraction (torch.profiler)
#               and the trace's spans of a step (timed by events on the streams)
#  stage0/3     torchrun, 1 process: train_gpt.py --preset gpt2 --steps 30 on NCCL: tok/s,
#               MFU, peak max_memory_allocated vs the formula
# With 2+ GPUs, also (beyond the 8 minutes): N ranks, N = min(4, GPUs) processes:
# train_gpt.py at stages 0 and 3, on the ring (--no-native) and on NCCL's own collectives;
# on one GPU the summary says "multi-rank NCCL: not tested (1 GPU)" (NCCL refuses two
# ranks on one device). The CPU mode runs the tiny equivalence subset, stage0/3 on gloo
# and bench --gpu (which the GPU mode leaves to `python -m bench --gpu`).
# Each step has a time limit; a failed step is named in the summary and the rest still
# run. Logs go to $GPU_CHECK_LOGS (default: a new temporary directory).
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-$(command -v python3 || command -v python)}
mode=gpu
if [[ "${1:-}" == "--cpu" ]] || ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    mode=cpu
    export CUDA_VISIBLE_DEVICES=""  # the CPU, even where a GPU is present: every step below picks CUDA if it sees one
fi
gpus=0
[[ $mode == cpu ]] || gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
ranks=$((gpus < 4 ? gpus : 4))
logs=${GPU_CHECK_LOGS:-$(mktemp -d)}
mkdir -p "$logs"
failed=()
finished=0
start=$SECONDS
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output to the screen and NAME.log
    local name=$1 limit=$2 rc=0 t0=$SECONDS
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$logs/$name.log" || rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    if ((rc == 124 || rc == 137)); then
        failed+=("$name (timed out after ${limit}s)")
    elif ((rc)); then
        failed+=("$name (exit $rc)")
    fi
    return 0
}

train() {  # what train_gpt.py printed: tok/s, MFU, peak memory against the model-state formula
    local log=$logs/$1.log
    [[ -s $log ]] || { echo "no output"; return; }
    local speed peak formula
    speed=$(grep -E '^[0-9.]+ ms/step' "$log" | tail -1 | sed -E 's/^[0-9.]+ ms\/step, //')
    peak=$(grep -oE '^peak memory per rank \([^)]*\): [0-9.]+ MiB' "$log" | tail -1 | awk '{printf "%.3g GiB", $(NF-1) / 1024}')
    formula=$(grep -E 'model state per rank, ' "$log" | awk '{s += $(NF-2)} END {printf "%.3g GiB", s / 1024}')
    echo "${speed:-no speed}, peak ${peak:-?} vs formula ${formula:-?} (model state)"
}

passed() {  # pytest's last count line in NAME.log
    grep -E '^(=+ )?[0-9]+ (passed|failed|errors?)' "$logs/$1.log" 2>/dev/null | tail -1 | sed -E 's/ in [0-9.]+s.*//; s/=+//g; s/^ +| +$//g'
}

probe() {  # what tests/gpu_probe.py printed for NAME
    grep -h "^probe $1: " "$logs"/*.log 2>/dev/null | tail -1 | sed "s/^probe $1: //"
}

summary() {
    local rc=$? line bench list
    set +e
    ((finished)) || failed+=("the script itself (stopped early, exit $rc)")
    list=$(printf ', %s' "${failed[@]}")
    [[ ${#failed[@]} -gt 0 ]] || list=", none"
    line="versions: $(probe versions); equivalence $(passed equivalence || true);"
    if [[ $mode == gpu ]]; then
        line+=" wait: $(probe wait); csan $(passed csan); jitter $(passed jitter), strict_p2p $(passed strict);"
        line+=" host_reads on CUDA $(passed host_reads); $(probe syncs); offload: $(probe offload);"
        line+=" $(probe profile);"
    else
        bench=$(grep '^summary:' "$logs/bench.log" 2>/dev/null | tail -1 | sed 's/^summary: //')
        line+=" GPU probes: not run (cpu); bench: ${bench:-no result};"
    fi
    line+=" gpt2 stage0 $(train stage0); stage3 $(train stage3);"
    if ((ranks > 1)); then
        line+=" $ranks ranks:"
        for run in ring-stage0 native-stage0 ring-stage3 native-stage3; do
            line+=" $run $(train "$run");"
        done
    else
        line+=" multi-rank NCCL: not tested ($gpus GPU$( ((gpus == 1)) || echo s ));"
    fi
    echo
    echo "gpu_check ($mode, $((SECONDS - start)) s): $line failed: ${list:2}"
}
trap summary EXIT

echo "mode $mode; logs in $logs"
step versions 30 "$PY" tests/gpu_probe.py versions
if [[ $mode == gpu ]]; then
    gpu=(env MINIZERO_DEVICE=cuda HYPOTHESIS_PROFILE=quick CUBLAS_WORKSPACE_CONFIG=:4096:8)
    step wait 20 "$PY" tests/gpu_probe.py wait
    step equivalence 90 "${gpu[@]}" "$PY" -m pytest -q test_equivalence.py
    step csan 60 "${gpu[@]}" "$PY" tests/gpu_probe.py csan -- -q -x test_equivalence.py
    step jitter 40 "${gpu[@]}" "$PY" tests/gpu_probe.py jitter -- -q -x test_equivalence.py
    step strict 40 "${gpu[@]}" MINIZERO_STRICT_P2P=1 "$PY" tests/gpu_probe.py jitter -- -q -x test_equivalence.py
    step host_reads 40 env MINIZERO_DEVICE=cuda "$PY" -m pytest -q tests/test_host_reads.py
    step probes 60 "$PY" tests/gpu_probe.py syncs offload profile
    size=(--preset gpt2 --steps 30 --sample-tokens 0)
    train_limit=55
else  # tiny: every code path the GPU run takes that a CPU has (torchrun on gloo, the preset, bench --gpu)
    step equivalence 60 env MINIZERO_DEVICE=cpu "$PY" -m pytest -q test_equivalence.py -k "on_the_device or sender_made"
    size=(--preset gpt2 --n-layer 1 --n-head 2 --n-embd 32 --block-size 16 --batch-size 2 --steps 3
          --eval-iters 1 --sample-tokens 0)
    train_limit=60
fi
for stage in 0 3; do
    step "stage$stage" "$train_limit" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
        train_gpt.py "${size[@]}" --stage "$stage" --native
done
[[ $mode == gpu ]] || step bench 90 "$PY" -m bench --gpu
if ((ranks > 1)); then
    for stage in 0 3; do
        for ring in ring native; do
            flag=--native
            [[ $ring == ring ]] && flag=--no-native
            step "$ring-stage$stage" "$train_limit" "$PY" -m torch.distributed.run --standalone \
                --nproc_per_node="$ranks" train_gpt.py "${size[@]}" --stage "$stage" "$flag"
        done
    done
fi
finished=1
((${#failed[@]} == 0))
