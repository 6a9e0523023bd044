#!/usr/bin/env bash
# `hetplan run` of two source trees, then the reference loops, on one GPU in one sitting
# (the runtime's overhead before and after a change, with its baseline on the same machine).
#   bash bench/gpu/before_after.sh NEW_SRC BASE_SRC   (each a folder holding hetplan/)
# The plan is compiled on the machine (a plan's model fingerprint comes from its capture
# there). AGAIN=1 runs NEW_SRC a second time after the reference loops. Results go to $OUT.
set -u
NEW=$1; BASE=$2; OUT=${OUT:-bench/results/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
HP=(python3 -c 'import sys; from hetplan.cli import main; sys.argv[0] = "hetplan"; main()')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 90 "${HP[@]}" plan gpt2 --cluster bench/gpu/h200-1.yaml \
  -b 8 -o "$OUT/plan_gpt2.json" | tail -1
run() {  # label source-tree
  PYTHONPATH=$2:${PYTHONPATH:-} timeout 150 "${HP[@]}" run "$OUT/plan_gpt2.json" --model gpt2 \
    --steps 20 --report "$OUT/run_$1.json" > "$OUT/run_$1.log" 2>&1
  echo "$1 exit $?"; grep -E "^measured|error" "$OUT/run_$1.log" | tail -2
}
run new "$NEW"
run base "$BASE"
PYTHONPATH=$NEW:${PYTHONPATH:-} timeout 150 python3 -m torch.distributed.run --standalone \
  --nproc-per-node 1 bench/gpu/reference_loop.py --model gpt2 --batch 8 --loss fp32,bf16 \
  --out "$OUT/reference_loop.json" 2>&1 | grep -E "ms/iteration|Error"
[ -n "${AGAIN:-}" ] && run new2 "$NEW"
