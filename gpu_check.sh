#!/usr/bin/env bash
# The GPU check (issue 15): minizero's GPU path in one command and one summary line,
# under 8 minutes on one H200.
#
#   bash gpu_check.sh          # with CUDA; on a machine without it, the same as --cpu
#   bash gpu_check.sh --cpu    # tiny and CPU-only, under a minute: CI proves it still starts
#
# 1. equivalence  test_equivalence.py with every thread rank on the GPU (world sizes 1-5,
#                 every stage, fp32/bf16/fp16, overlap, the same bits across stages)
# 2. stage0/3     torchrun, 1 process: train_gpt.py --preset gpt2 --steps 30, native
#                 collectives on NCCL: tok/s, MFU, peak max_memory_allocated vs the formula
# 3. bench        python -m bench --gpu: a plain torch loop against minizero in one process
#                 (the overhead ratio), and the native rows at the world size the GPUs allow
# With 2+ GPUs, also:
# 4. strict       test_equivalence.py again, under NCCL's point-to-point rules (strict_p2p)
# 5. N ranks      torchrun, N = min(4, GPUs) processes: train_gpt.py at stages 0 and 3, on
#                 the ring (--no-native: batched point-to-point on NCCL) and on NCCL's own
#                 collectives (--native)
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

summary() {
    local rc=$? eq bench list
    set +e
    ((finished)) || failed+=("the script itself (stopped early, exit $rc)")
    list=$(printf ', %s' "${failed[@]}")
    [[ ${#failed[@]} -gt 0 ]] || list=", none"
    eq=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?)' "$logs/equivalence.log" 2>/dev/null | tail -1 | sed -E 's/=+//g; s/^ +| +$//g')
    bench=$(grep '^summary:' "$logs/bench.log" 2>/dev/null | tail -1 | sed 's/^summary: //')
    multi=""
    if ((ranks > 1)); then
        strict=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?)' "$logs/strict.log" 2>/dev/null | tail -1 | sed -E 's/=+//g; s/^ +| +$//g')
        multi=" strict_p2p equivalence ${strict:-no result}; $ranks ranks:"
        for run in ring-stage0 native-stage0 ring-stage3 native-stage3; do
            multi+=" $run $(train "$run");"
        done
    fi
    echo
    echo "gpu_check ($mode, $((SECONDS - start)) s): equivalence ${eq:-no result}; gpt2 stage0 $(train stage0);" \
         "stage3 $(train stage3);$multi bench: ${bench:-no result}; failed: ${list:2}"
}
trap summary EXIT

"$PY" -c 'import torch; print("torch", torch.__version__, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")' \
    || echo "$PY cannot import torch"
echo "mode $mode; logs in $logs"
if [[ $mode == gpu ]]; then
    step equivalence 150 env MINIZERO_DEVICE=cuda HYPOTHESIS_PROFILE=quick CUBLAS_WORKSPACE_CONFIG=:4096:8 \
        "$PY" -m pytest -q test_equivalence.py
    size=(--preset gpt2 --steps 30 --sample-tokens 0)
    train_limit=100 bench_limit=120
else  # tiny: every code path the GPU run takes that a CPU has (torchrun on gloo, the preset, bench --gpu)
    step equivalence 60 env MINIZERO_DEVICE=cpu "$PY" -m pytest -q test_equivalence.py -k "on_the_device or sender_made"
    size=(--preset gpt2 --n-layer 1 --n-head 2 --n-embd 32 --block-size 16 --batch-size 2 --steps 3
          --eval-iters 1 --sample-tokens 0)
    train_limit=60 bench_limit=90
fi
for stage in 0 3; do
    step "stage$stage" "$train_limit" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
        train_gpt.py "${size[@]}" --stage "$stage" --native
done
step bench "$bench_limit" "$PY" -m bench --gpu
if ((ranks > 1)); then
    step strict 150 env MINIZERO_DEVICE=cuda MINIZERO_STRICT_P2P=1 HYPOTHESIS_PROFILE=quick \
        CUBLAS_WORKSPACE_CONFIG=:4096:8 "$PY" -m pytest -q test_equivalence.py
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
