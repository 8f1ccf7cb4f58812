# Step runner shared by the one-call GPU scripts (gpu_check.sh, ring_two_gpus.sh); sourced, with
# $here (the repository) and $out (the logs' folder) set: it makes $out and puts the source
# tree's python/ first on PYTHONPATH. Every step runs even after one failed (one run shows every
# problem); finish_steps NAME exits 1 when any failed. Each step's exit status is taken from the
# command itself, never from a pipe's last stage.
mkdir -p "$out"
export PYTHONPATH="$here/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
failed=()

# run_step NAME LOG COMMAND...: COMMAND's output goes to $out/LOG (its tail to the console); a
# non-zero exit records NAME as failed. `|| rc=$?` keeps set -e from ending the script there.
run_step() {
  local name="$1" log="$out/$2"
  shift 2
  echo
  echo "=== $name ($(date +%T))"
  local rc=0
  "$@" >"$log" 2>&1 || rc=$?
  tail -n 30 "$log"
  if [ "$rc" -ne 0 ]; then
    echo "=== $name: FAILED (exit $rc, log $log)"
    failed+=("$name")
  fi
}

# finish_steps NAME: the verdict line, and the exit status (0 when every step passed).
finish_steps() {
  echo
  if [ "${#failed[@]}" -eq 0 ]; then
    echo "$1: PASS (logs in $out)"
    exit 0
  fi
  echo "$1: FAIL: ${#failed[@]} step(s) failed (logs in $out):"
  printf '  %s\n' "${failed[@]}"
  exit 1
}
