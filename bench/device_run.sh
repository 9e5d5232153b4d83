#!/usr/bin/env bash
# One run of bench/serve.py on the lent 16-core machine (issue 32): the three set-ups of the issue's table, MobileNetV2
# FP32 and INT8, 8 and 32 clients, naive and binary OIP, each set-up's JSON and log written to $OUT as it ends (a
# set-up that runs out of time loses only itself). At most 8 minutes there (200 + 140 + 140 s); run it once:
#   ../shared/tools/device-prep                      # here, first: the wheels that machine lacks, into .device/
#   bash bench/device_run.sh                         # there (the run tool carries .device along)
# Here, to check it runs before spending device time (2 CPUs: the set-ups shrink to what this box has):
#   DEVICE_RUN_LOCAL=1 REQUESTS=200 bash bench/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REQUESTS=${REQUESTS:-1000}   # timed requests per level (the issue's table used 2,500)
LIMIT_S=${LIMIT_S:-0.4}      # seconds per batch size and layout for the limit
WORK=$(mktemp -d)            # bundles compiled once, reused by every set-up
PY=python3
if [ -n "${DEVICE_RUN_LOCAL:-}" ]; then
  PY=.venv/bin/python
else
  # shellcheck disable=SC1091
  source .device/env.sh || exit 1
fi
COMMON=(--models mobilenetv2-fp32,mobilenetv2-int8 --clients 8,32 --variants naive,binary --warmup 10
        --requests-big "$REQUESTS" --limit-seconds "$LIMIT_S" --work-dir "$WORK")

run() {  # NAME SECONDS CPUS -- ARGS...: one set-up under taskset, its own time limit, JSON and log into $OUT
  local name=$1 secs=$2 cpus=$3
  shift 4
  echo "== $name: taskset -c $cpus bench/serve.py $* (at most ${secs}s)" | tee -a "$OUT/device_run.log"
  local t0=$SECONDS
  timeout -k 10 "$secs" taskset -c "$cpus" $PY bench/serve.py "$@" "${COMMON[@]}" --json "$OUT/$name.json" \
    > "$OUT/$name.txt" 2> "$OUT/$name.err"
  echo "   exit $? after $((SECONDS - t0))s" | tee -a "$OUT/device_run.log"
  mkdir -p "$OUT/$name-logs" && cp "$WORK"/logs/*.log "$OUT/$name-logs/" 2>/dev/null  # the agents' own logs (layout trial)
  grep -h "layout .* timed in" "$OUT/$name-logs/"*-agent.log 2>/dev/null | cut -c1-400 | tee -a "$OUT/device_run.log"
  rm -f "$WORK"/logs/*.log
  sed -n '/^bench\/serve.py:/,$p' "$OUT/$name.txt" | tee -a "$OUT/device_run.log" | cut -c1-300
}

{ echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; $(date -u +%FT%TZ)"
  lscpu 2>/dev/null | grep -E '^Model name|^Flags' | sed 's/^Flags:.*\(avx512_vnni\).*/Flags: ... \1 .../' ; } \
  | tee "$OUT/device_run.log"

if [ -n "${DEVICE_RUN_LOCAL:-}" ]; then  # this 2-CPU box: the same three shapes, shrunk
  run pinned1 900 0-1 -- --pin --inference-cpus 1
  run unpinned2 900 0-1 -- --threads 2
else
  run pinned4 200 8-15 -- --pin --threads 4 --inference-cpus 12,13,14,15
  run unpinned8 140 0-7 -- --threads 8
  run pinned8 140 0-15 -- --pin --inference-cpus 8,9,10,11,12,13,14,15
fi
rm -rf "$WORK"
echo "done: $(ls "$OUT")" | tee -a "$OUT/device_run.log"
