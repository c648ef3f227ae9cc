#!/usr/bin/env bash
# The GPU checks in one run of under 10 minutes (issue 33), each step bounded by what is left of
# GPU_RUN_BUDGET_S (570 s) and logged; a failed step fails the run but not the steps after it:
#   1. checkpoint  builtin:qwen2.5-0.5b-bench (GPU_MODEL) built offline from the carried tokenizer
#                  (bench/gpu_checkpoint.py: 1 GB of random weights in ~10 s; too big to carry)
#   2. parity      the engine (CUDA graphs on) vs transformers, token for token, float32 and
#                  bfloat16; decode-step time at batch 1/8/32/64, graphs on and off, as a share
#                  of the card's bandwidth (bench/gpu_parity.py)
#   3. kernels     Triton decode / prefill vs SDPA, the batch 1-8 split sweep (bench/kernels.py)
#   4. serving     both cluster modes on the checkpoint at 1 / 8 / 32 / 64 clients: tok/s, TTFT,
#                  ITL (bench/serving.py --no-baselines --aggregated-levels)
#   5. tests       the kernel tests and the GPU-only engine tests on the GPU (builds builtin:tiny)
#   6. quant       bench/kernels_quant_gpu.py, if time is left
# Results: $OUT/gpu-<card>/ (else bench/results/gpu-<card>/), <card> from nvidia-smi: gpu.txt,
# steps.txt, parity.json, kernels.json, serving.json, kernels_quant_gpu.json, summary.md (all
# of it as tables, bench/gpu_summary.py) and logs.tar.gz: at most 8 files, as a lend returns.
#
#   bash bench/gpu_wheels.sh    # here, once: .whl/ (wheels + SmolLM2's tokenizer, < 64 MiB)
#   run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=600)     # the lent GPU
#   bash bench/gpu_run.sh --dry-run   # here: every step on the CPU at tiny sizes, into a temp dir
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
budget=${GPU_RUN_BUDGET_S:-570}
start=$(date +%s)
status=0
export PYTHONUNBUFFERED=1
work=$(mktemp -d /tmp/gpu-run.XXXXXX)
logs=$work/logs
mkdir -p "$logs"

if [ $dry = 1 ]; then
    py=${PYTHON:-.venv/bin/python}
    device=cpu
    card="cpu (dry run)"
    slug=cpu-dry-run
    out=${OUT:-$work}/gpu-$slug
    tokenizer_dir=$work/smollm2-tokenizer  # what gpu_wheels.sh puts in .whl/, made here
    $py -m bench.gpu_checkpoint --save-tokenizer "$tokenizer_dir" >/dev/null || exit 1
else
    py=python3
    device=cuda
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
        # The frontend reads its version from the installed project's metadata.
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
            || exit 1
    fi
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    slug=$(PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} $py -m bench.gpu_summary --slug "$card")
    out=${OUT:-bench/results}/gpu-$slug
    tokenizer_dir=.whl/smollm2-tokenizer
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
: >"$out/steps.txt"
{
    if [ $dry = 1 ]; then echo "$card"; else
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
    $py -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee "$out/gpu.txt"

# step NAME LIMIT_S CMD...: CMD's output into $logs/NAME.log, bounded by LIMIT_S and the budget.
step() {
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$((budget - ($(date +%s) - start)))
    if ((left < 30)); then
        echo "$name: skipped, ${left}s of the budget left" | tee -a "$out/steps.txt"
        status=1
        return 1
    fi
    ((limit > left)) && limit=$left
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - t0))s (limit ${limit}s)" | tee -a "$out/steps.txt"
    tail -n 12 "$logs/$name.log"
    ((rc != 0)) && status=1
    return $rc
}

# 1. the checkpoint
model=${GPU_MODEL:-builtin:qwen2.5-0.5b-bench}
tokenizer_args=()
[ -d "$tokenizer_dir" ] && tokenizer_args=(--tokenizer-from "$tokenizer_dir")
if [ $dry = 1 ]; then
    step checkpoint 120 $py -m bench.gpu_checkpoint "$model" "${tokenizer_args[@]}" \
        --small "$work/model"
    serve_model=$work/model
else
    step checkpoint 120 $py -m bench.gpu_checkpoint "$model" --dtype bfloat16 "${tokenizer_args[@]}"
    serve_model=$model
fi
model_dir=$(grep '^/' "$logs/checkpoint.log" | tail -n 1) # the directory it printed last

# 2. parity and decode steps (float32 through the bfloat16 weights: one build, one directory)
small=()
[ $dry = 1 ] && small=(--prompts 2 --max-tokens 6 --step-batches 1 4 --step-prompt-len 16
    --steps 3 --num-blocks 256)
step parity 200 $py -m bench.gpu_parity --model "$model_dir" --device $device "${small[@]}" \
    --out "$out/parity.json"

# 3. the kernels
dry_flag=()
[ $dry = 1 ] && dry_flag=(--dry-run)
step kernels 200 $py -m bench.kernels "${dry_flag[@]}" --out "$out/kernels.json"

# 4. serving, both modes
small=()
[ $dry = 1 ] && small=(--concurrency 1 2 --prompt-len 16 32 --output-len 4 8)
step serving 300 $py -m bench.serving --device $device --model "$serve_model" --repeats 1 \
    --no-profile --no-baselines --aggregated-levels "${small[@]}" --out "$logs/serving.json" &&
    cp "$logs/serving.json" "$out/serving.json"
find /tmp -maxdepth 2 -path '/tmp/pdcluster-bench-*/cluster-*.log' -newer "$work" \
    -exec cp {} "$logs/" \; 2>/dev/null # why a cluster did not start

# 5. the tests that need a GPU (collected only, on the CPU)
tests=(tests/unit/engine/kernels/test_kernels.py tests/unit/engine/kernels/test_triton_moe.py
    tests/unit/engine/test_cuda_graphs.py
    tests/unit/engine/test_llm_engine.py::test_greedy_on_the_gpu_matches_hf_on_the_cpu)
collect=()
[ $dry = 1 ] && collect=(--collect-only)
step tests 200 $py -m pytest -q -p no:cacheprovider "${collect[@]}" "${tests[@]}"

# 6. the quantized matmul, with what is left
step quant 240 $py -m bench.kernels_quant_gpu "${dry_flag[@]}" --out "$out/kernels_quant_gpu.json"

$py -m bench.gpu_summary "$out" >/dev/null || status=1
tar -czf "$out/logs.tar.gz" -C "$logs" . || status=1
echo "== $out ($(($(date +%s) - start))s, status $status)"
cat "$out/summary.md"
if [ $dry = 1 ]; then
    if [ -n "${OUT:-}" ]; then rm -rf "$work"; else echo "dry run: $out"; fi
fi
exit $status
