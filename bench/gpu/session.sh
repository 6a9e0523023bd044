#!/usr/bin/env bash
# The checks a lent GPU machine runs, in one go (see bench/README.md, "GPU checks"):
#   1. the `gpu`-marked tests (NCCL runtime path, CUDA compressors);
#   2. bench/gpu_kernels.py: GEMM / attention / memory-bound throughput of this GPU;
#   3. profile -> plan --profile -> run for gpt2 on this one GPU, predicted against measured;
#   4. the same training as plain PyTorch, DDP and FSDP2 loops (the runtime's overhead).
# Every step has its own timeout; results go to $OUT (or bench/results/gpu when run by hand).
# Python deps missing on the machine travel as wheels in .whl/ (pydantic, plotly, ...).
set -u
OUT=${OUT:-bench/results/gpu}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
fi
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
HP=(python3 -c 'import sys; from hetplan.cli import main; sys.argv[0] = "hetplan"; main()')
step() { echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
if [ -z "${ONLY_RUN:-}" ]; then
step "gpu tests"
timeout "${GPU_TESTS_S:-200}" python3 -m pytest -m gpu tests -q -p no:cacheprovider -rs 2>&1 \
  | tail -40 | tee "$OUT/pytest_gpu.txt"
if [ -z "${SKIP_KERNELS:-}" ]; then
step "kernels"
timeout "${KERNELS_S:-150}" python3 bench/gpu_kernels.py ${KERNELS_ARGS:-} \
  --out "$OUT/gpu_kernels.json" 2>&1 | tail -5
fi
fi
step "profile -> plan -> run (gpt2, 1 GPU)"
C=bench/gpu/h200-1.yaml
timeout 120 "${HP[@]}" profile gpt2 --device-type H200-141GB -n 1 --what layers --batch-size 8 --dtype bf16 --dtype fp32 \
  -o "$OUT/profile_h200.json" 2>&1 | tail -5
timeout 90 "${HP[@]}" profile gpt2 --device-type H200-141GB -n 1 --what step --batch-size 8 \
  -o "$OUT/profile_h200.json" 2>&1 | tail -3
for p in analytic profiled; do
  extra=(); [ $p = profiled ] && extra=(--profile "$OUT/profile_h200.json")
  timeout 120 "${HP[@]}" plan gpt2 --cluster $C -b 8 "${extra[@]}" -o "$OUT/plan_$p.json" 2>&1 \
    | grep -E "predicted iteration|compute " 
  timeout 150 "${HP[@]}" run "$OUT/plan_$p.json" --model gpt2 --steps 20 \
    --report "$OUT/run_$p.json" > "$OUT/run_$p.log" 2>&1; echo "exit $?"; tail -3 "$OUT/run_$p.log"
done
step "reference loops: plain PyTorch, DDP, FSDP2 (gpt2, bf16 autocast, Adam)"
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/gpu/reference_loop.py --model gpt2 --batch 8 --loss fp32,bf16 --out "$OUT/reference_loop.json" 2>&1 | tail -7
step done
