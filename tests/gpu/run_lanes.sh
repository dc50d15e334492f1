#!/bin/bash
# Run GPU test files in parallel lanes on one device, each lane under a time limit, and say
# which lane passed, failed or was cut; failures print as they happen (tests/conftest.py), so a
# cut lane still shows why its tests failed.
#
#   bash tests/gpu/run_lanes.sh LOGDIR SECONDS FILES... [-- FILES... [-- ...]]
#
# Each group of test files between `--` is one lane (one pytest process, its files in order);
# logs go to LOGDIR/laneN.log and the one-line results to LOGDIR/lanes.log. Balance the lanes
# by the durations docs/gpu.md lists (test_kernel_attention_gpu.py needs ~400 s alone).
set -u
logs=$1 limit=$2
shift 2
mkdir -p "$logs"
start=$SECONDS
lane=0 files=()
run_lane() {
  local n=$1
  shift
  timeout "$limit" python3 -m pytest -q --tb=short -p no:cacheprovider "$@" > "$logs/lane$n.log" 2>&1
  local rc=$?
  local verdict=passed
  [ $rc -eq 124 ] && verdict="cut at ${limit} s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="failed (rc $rc)"
  echo "lane $n: $verdict after $((SECONDS - start)) s: $*" >> "$logs/lanes.log"
}
for arg in "$@" --; do
  if [ "$arg" = "--" ]; then
    [ ${#files[@]} -gt 0 ] && { run_lane $lane "${files[@]}" & lane=$((lane + 1)); }
    files=()
  else
    files+=("$arg")
  fi
done
wait
cat "$logs/lanes.log"
