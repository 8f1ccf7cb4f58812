#!/usr/bin/env bash
# Pre-merge check on a GPU machine: the test suite with the kernel library required, compute-
# sanitizer memcheck / racecheck / synccheck on small cases, and a quick benchmark whose reference
# checks run on the timed configurations.
#
#   bash bench/gpu_check.sh [OUT_DIR]
#
# Logs and results go to OUT_DIR, else to $OUT when it is set (the device runner brings that folder
# back), else to bench/results/gpu_check. Uses the installed flash_hopper, or the source tree's
# python/ with FLASH_HOPPER_LIB pointing at a built libflash_hopper.so (a file or its folder).
# PYTHON picks the interpreter; FH_CHECK_SKIP may list steps to skip (tests, sanitizer, fuzz,
# bench); FH_FUZZ_SECONDS / FH_FUZZ_SEED the fuzz run's length and seed;
# FH_SANITIZER_BACKENDS the paths the sanitizer runs (default: fa2 fa3), FH_SANITIZER_BWD_BACKENDS
# those it runs the backward on (default: fa2 fa3; each path on the buckets it has a backward for).
#
# Every step runs even after one failed (one run shows every problem), and any failure fails the
# script (bench/steps.sh).
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-${OUT:-$here/bench/results/gpu_check}}"
# shellcheck source=steps.sh
source "$here/bench/steps.sh"
# Without it a missing or unloadable library turns every kernel test into a skip and the suite
# "passes" (tests/conftest.py).
export FLASH_HOPPER_REQUIRE_LIB=1
skip=" ${FH_CHECK_SKIP:-} "
py="${PYTHON:-python3}"

skipped() {
  if [[ "$skip" == *" $1 "* ]]; then
    echo
    echo "=== $1: skipped (FH_CHECK_SKIP)"
    return 0
  fi
  return 1
}

run_step "nvidia-smi" nvidia_smi.csv nvidia-smi \
  --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
run_step "build info" build_info.json "$py" -c \
  "import flash_hopper, json; print(json.dumps(flash_hopper.build_info()))"

if ! skipped tests; then
  run_step "pytest" pytest.log "$py" -m pytest -q -rs -p no:cacheprovider "$here/tests" \
    --junitxml="$out/pytest.xml"
fi

if ! skipped sanitizer; then
  # memcheck: out-of-bounds and misaligned accesses of the predicated tail paths. racecheck:
  # shared-memory hazards of ordinary loads and stores (it does not see TMA / WGMMA async-proxy
  # traffic: test_deterministic covers those). synccheck: named-barrier and mbarrier misuse of
  # the warp-specialized FA-3 path. --report-api-errors no: cuda-python probes driver entry points
  # this driver lacks (cuGetProcAddress errors by design); only device-side errors count.
  for backend in ${FH_SANITIZER_BACKENDS:-fa2 fa3}; do
    for tool in memcheck racecheck synccheck; do
      run_step "compute-sanitizer $tool ($backend)" "sanitizer_${tool}_$backend.log" \
        compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
        "$py" "$here/bench/sanitizer_case.py" --backend "$backend" --num-sms 3
    done
  done
  # The serving paths' memory safety with the value checks off (as under graph capture): bad
  # offsets, out-of-range cache / page-table indices, expanded index tensors, on the decode kernel
  # and the varlen paths. Nothing outside the caller's tensors may be touched.
  # (FH_TEST_UNDER_SANITIZER: a test that counts launches with the profiler skips the count,
  # which CUPTI cannot take beside the sanitizer)
  run_step "compute-sanitizer memcheck (serving hazards)" sanitizer_memcheck_serving.log \
    env FH_TEST_UNDER_SANITIZER=1 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$py" -m pytest -q -p no:cacheprovider "$here/tests/test_decode_gpu.py" \
    "$here/tests/test_varlen_gpu.py" -k "unchecked or expanded or never_fault or hint"
  # The backward (its forward too), default and deterministic mode, on the paths that have one.
  for backend in ${FH_SANITIZER_BWD_BACKENDS:-fa2 fa3}; do
    for tool in memcheck racecheck synccheck; do
      run_step "compute-sanitizer $tool bwd ($backend)" "sanitizer_${tool}_bwd_$backend.log" \
        compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
        "$py" "$here/bench/sanitizer_case.py" --backend "$backend" --num-sms 3 --direction bwd
    done
  done
fi

if ! skipped fuzz; then
  # Random valid calls of the public API judged by FA3's rule against the float reference, and
  # every invalid call (tests/fuzz_api.py); then short random calls under memcheck (the odd
  # shapes' tails, the varlen offsets, the KV-cache appends).
  run_step "API fuzz" fuzz.log "$py" "$here/tests/fuzz_api.py" --seconds "${FH_FUZZ_SECONDS:-120}" \
    --seed "${FH_FUZZ_SEED:-0}" --out "$out/fuzz.json"
  run_step "API fuzz under memcheck" fuzz_memcheck.log compute-sanitizer --tool memcheck \
    --report-api-errors no --error-exitcode 9 "$py" "$here/tests/fuzz_api.py" --small \
    --seconds 60 --seed "${FH_FUZZ_SEED:-0}" --out "$out/fuzz_memcheck.json"
fi

if ! skipped bench; then
  # 4k at d128 times (and checks) the 128 x 176 tile, 1k the short-masked 128 x 128 one.
  run_step "quick benchmark" bench.log "$py" -m flash_hopper bench --seqlen 1024 4096 \
    --head-dim 64 128 --json "$out/bench.json"
fi

finish_steps gpu_check
