#!/usr/bin/env bash
# Ring attention on a two-GPU machine in one call: the distributed GPU tests (the NCCL ones run
# with 2 GPUs), the README's ring example under torchrun, and the scaling measurement with its
# per-rank timelines (bench/ring_scaling.py: one sequence of 128k and 256k tokens, d128, 16 / 4
# heads, causal zigzag and non-causal, sm_margin 0 / 2 / 4 / 8: NCCL needs as many free SMs as its
# kernel has CTAs to run beside ours).
#
#   bash bench/ring_two_gpus.sh [OUT_DIR]
#
# Logs and ring_scaling.json go to OUT_DIR, else $OUT (the device runner brings it back), else
# bench/results/ring_two_gpus. Uses the installed flash_hopper, or the source tree's python/ with
# FLASH_HOPPER_LIB pointing at a built library (bf16 d64 / d128, fwd + bwd). PYTHON picks the
# interpreter; FH_RING_SEQLENS / FH_RING_MARGINS override the scaling points. FH_RING_DEVICE=cpu
# runs the example and the scaling script on 2 CPU processes over gloo with small sizes instead
# (tests/test_bench_scripts.py checks the script that way). Every step runs even after one
# failed; any failure fails the script.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-${OUT:-$here/bench/results/ring_two_gpus}}"
# shellcheck source=steps.sh
source "$here/bench/steps.sh"
py="${PYTHON:-python3}"
device="${FH_RING_DEVICE:-cuda}"

torchrun=("$py" -m torch.distributed.run --standalone --nproc-per-node 2)
if [ "$device" = "cuda" ]; then
  gpus="$("$py" -c 'import torch; print(torch.cuda.device_count())')"
  if [ "$gpus" -lt 2 ]; then
    echo "ring_two_gpus: needs 2 GPUs, found $gpus"
    exit 2
  fi
  export FLASH_HOPPER_REQUIRE_LIB=1
  run_step "nvidia-smi" nvidia_smi.csv nvidia-smi \
    --query-gpu=index,name,clocks.sm,clocks.max.sm,memory.total --format=csv
  run_step "topology" topology.txt nvidia-smi topo -m
  run_step "distributed GPU tests" pytest.log "$py" -m pytest -q -rs -p no:cacheprovider \
    "$here/tests/test_distributed_gpu.py"
  run_step "README example" example.log "${torchrun[@]}" "$here/examples/ring_attention.py"
  read -r -a seqlens <<<"${FH_RING_SEQLENS:-131072 262144}"
  read -r -a margins <<<"${FH_RING_MARGINS:-0 2 4 8}"
  run_step "scaling" scaling.log "${torchrun[@]}" "$here/bench/ring_scaling.py" \
    --seqlens "${seqlens[@]}" --sm-margins "${margins[@]}" --out "$out/ring_scaling.json"
else
  export OMP_NUM_THREADS=1
  run_step "README example" example.log "${torchrun[@]}" "$here/examples/ring_attention.py" \
    --device cpu --seqlen 128 --head-dim 32 --heads 4/2
  run_step "scaling" scaling.log "${torchrun[@]}" "$here/bench/ring_scaling.py" --device cpu \
    --seqlens 128 --head-dim 16 --heads 2/1 --iters 1 --out "$out/ring_scaling.json"
fi

finish_steps ring_two_gpus
