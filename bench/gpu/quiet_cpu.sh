#!/usr/bin/env bash
# CPU benchmarks that need a quiet multi-core machine, run on the lent GPU machine's host
# (16 cores, nothing else running): Gemini's overhead (bench/gemini.py) and Espresso's
# selection time (bench/espresso.py). Results go to $OUT (or bench/results/gpu by hand).
set -u
OUT=${OUT:-bench/results/gpu}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
fi
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
echo "=== $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -z "${SKIP_GEMINI:-}" ]; then
echo "=== gemini ($(date +%T))"
timeout "${GEMINI_S:-240}" python3 bench/gemini.py ${GEMINI_ARGS:-} 2>&1 | tail -25
cp bench/results/gemini_cpu.json "$OUT/gemini_quiet.json"
fi
if [ -z "${SKIP_ESPRESSO:-}" ]; then
echo "=== espresso selection ($(date +%T))"
timeout "${ESPRESSO_S:-200}" python3 bench/espresso.py --out "$OUT/espresso_quiet.json" 2>&1 | tail -45
fi
echo "=== done ($(date +%T))"
