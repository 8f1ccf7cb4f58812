#!/usr/bin/env bash
# The serving paths' guarantees on one GPU, in one call of about 9 minutes: the decode / varlen /
# KV-cache GPU tests of the serving hazards first, then the decode and varlen GPU suites, the
# hazard tests under compute-sanitizer memcheck (value checks off inside them), the API fuzzer's
# hazard kind, and a short hazard fuzz under memcheck. bench/gpu_check.sh runs all of these as
# part of its longer steps; this is the short form for a device lease.
#
#   FLASH_HOPPER_LIB=path/to/libflash_hopper.so bash bench/serving_check.sh [OUT_DIR]
#
# The library needs bf16 forward kernels for d64 (the varlen tests) on both paths; the decode
# kernel is in every build. Logs and a summary go to OUT_DIR, else $OUT.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-${OUT:-$here/bench/results/serving_check}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$here/python${PYTHONPATH:+:$PYTHONPATH}" FLASH_HOPPER_REQUIRE_LIB=1 PYTHONUNBUFFERED=1
cd "$here"
summary="$out/summary.txt"
: > "$summary"
step() {  # step NAME SECONDS LOG COMMAND...: run with a time limit, record its status
  local name="$1" limit="$2" log="$3"
  shift 3
  timeout "$limit" "$@" > "$out/$log" 2>&1
  echo "$name rc=$?" >> "$summary"
}
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$py" -c "import flash_hopper, json; print(json.dumps(flash_hopper.build_info()))" \
  > "$out/build_info.json" 2>&1
step "pytest (serving hazards)" 120 pytest_new.log "$py" -m pytest -q -rs -p no:cacheprovider \
  tests/test_decode_gpu.py tests/test_serving_hazards.py -k "unchecked or hint or huge_windows \
or smaller_shared or expanded or minus_inf or past_the_table or serving or decode_stages or supports"
step "pytest (decode, varlen)" 150 pytest.log "$py" -m pytest -q -rs -p no:cacheprovider \
  tests/test_decode_gpu.py tests/test_varlen_gpu.py -k "not 64bit and not two_to_the_31"
step "memcheck (serving hazards)" 140 memcheck.log compute-sanitizer --tool memcheck \
  --report-api-errors no --error-exitcode 9 "$py" -m pytest -q -p no:cacheprovider \
  tests/test_decode_gpu.py tests/test_varlen_gpu.py -k "unchecked or expanded or never_fault or hint"
step "fuzz (hazard)" 70 fuzz.log "$py" tests/fuzz_api.py --kinds hazard --seconds 50 --seed 0 \
  --out "$out/fuzz_hazard.json"
step "fuzz under memcheck (hazard)" 80 fuzz_memcheck.log compute-sanitizer --tool memcheck \
  --report-api-errors no --error-exitcode 9 "$py" tests/fuzz_api.py --small --kinds hazard \
  --seconds 25 --seed 1 --out "$out/fuzz_memcheck.json"
cat "$summary"
! grep -qv " rc=0$" "$summary"
