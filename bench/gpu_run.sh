#!/usr/bin/env bash
# The GPU checks in one run (under 10 minutes on one H200): the Triton kernel tests and the
# engine's greedy parity on the GPU, the kernel benchmark, and the serving benchmark with --device
# cuda on the tiny model. Results (JSON and logs) go to $OUT, else bench/results/gpu/. On the device machine, after bench/gpu_wheels.sh
# here: run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=600).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
    # The frontend reads its version from the installed project's metadata.
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
    | tee -a "$out/gpu.txt"
status=0
timeout 120 python3 -m orchestrator.cli tiny-model 2>&1 | tail -2 || status=1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/kernels/test_kernels.py \
    tests/unit/engine/kernels/test_triton_moe.py \
    tests/unit/engine/test_llm_engine.py::test_greedy_on_the_gpu_matches_hf_on_the_cpu 2>&1 \
    | tee "$out/kernel-tests.log" | tail -3 || status=1
timeout 180 python3 -m bench.kernels --out "$out/kernels.json" >"$out/kernels.log" 2>&1 || status=1
tail -5 "$out/kernels.log"
timeout 300 python3 -m bench.serving --device cuda --repeats 1 --no-profile \
    --out "$out/serving.json" >"$out/serving.log" 2>&1 || status=1
tail -30 "$out/serving.log"
timeout 240 python3 -m bench.kernels_quant_gpu --out "$out/kernels_quant_gpu.json" 2>&1 \
    | tee "$out/kernels_quant_gpu.log" | tail -50 || status=1
cp /tmp/pdcluster-bench-*/cluster-*.log "$out/" 2>/dev/null  # why a cluster did not start
exit $status
