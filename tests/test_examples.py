"""The runnable examples and the distributed bench (CPU, two gloo processes under torchrun):
examples/ring_attention.py (the ring's output and gradients against attention over the whole
sequence: the README's ring example must run as written), bench/ring_scaling.py (the ring's
scaling measurement, its rows and its timeline arithmetic) and bench/ring_emulate.py (the ring's
per-rank share on one device)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, *args, torchrun=True):
    """Run a repository script on the CPU (under torchrun on 2 processes, or plain); its
    completed process, after asserting it exited 0."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [sys.executable, *(launcher if torchrun else []), str(ROOT / script), "--device",
           "cpu", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                            check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_example_runs_under_torchrun(causal):
    result = _run("examples/ring_attention.py", "--seqlen", "128", "--head-dim", "32", "--heads",
                  "4/2", *([] if causal else ["--no-causal"]))
    errors = dict(re.findall(r"(out|dq|dk|dv): max \|ring - single\| = (\S+)", result.stdout))
    assert set(errors) == {"out", "dq", "dk", "dv"}, result.stdout
    assert all(float(e) < 1e-4 for e in errors.values()), errors
    assert f"causal={causal}, cpu): done" in result.stdout


def test_ring_scaling_bench_runs_under_torchrun(tmp_path):
    """bench/ring_scaling.py (the ring's scaling measurement) end to end on 2 CPU processes: a
    row per (seqlen, mask) with the single / ring / compute-only times and their ratios."""
    import json

    out = tmp_path / "r.json"
    _run("bench/ring_scaling.py", "--seqlens", "128", "--head-dim", "16", "--heads", "2/1",
         "--iters", "1", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["causal"], r["layout"]) for r in rows] == [(True, "zigzag"), (False, "contiguous")]
    for r in rows:
        assert r["single_s"] > 0 and r["ring_s"] > 0 and r["compute_only_s"] > 0
        assert abs(r["speedup"] - r["single_s"] / r["ring_s"]) < 1e-9
        assert r["sm_margin"] == 0 and len(r["timeline"]) == 2


def _bench_module(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ring_timeline_overlap_from_kernel_intervals():
    """ring_scaling.kernel_overlap: NCCL time concurrent with compute kernels and the compute
    stream's gaps, on hand-made intervals (us): a transfer hidden under a kernel, one in a gap."""
    overlap = _bench_module("ring_scaling").kernel_overlap
    hidden = [("fwd_kernel", 0, 1000), ("ncclDevKernel_SendRecv", 100, 400),
              ("bwd_kernel", 1000, 3000)]
    r = overlap(hidden)
    assert r == {"nccl_ms": 0.3, "nccl_concurrent_ms": 0.3, "compute_ms": 3.0,
                 "compute_gaps_ms": 0.0, "nccl_kernels": 1}
    serial = [("fwd_kernel", 0, 1000), ("ncclDevKernel_SendRecv", 1000, 1500),
              ("bwd_kernel", 1500, 3000), ("merge", 2500, 2600)]
    r = overlap(serial)
    assert r["nccl_concurrent_ms"] == 0.0 and r["compute_gaps_ms"] == 0.5
    assert r["compute_ms"] == 2.5


def test_ring_emulation_runs_on_the_cpu(tmp_path):
    """bench/ring_emulate.py (the ring's per-rank share on one device, exchanges looped back)
    end to end on the CPU with the reference blocks: a row per mask, one entry per rank."""
    import json

    out = tmp_path / "e.json"
    _run("bench/ring_emulate.py", "--seqlens", "96", "--head-dim", "16", "--heads", "2/1",
         "--iters", "1", "--world", "3", "--out", str(out), torchrun=False)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["causal"], r["layout"]) for r in rows] == [(True, "zigzag"), (False, "contiguous")]
    for r in rows:
        assert [x["rank"] for x in r["ranks"]] == [0, 1, 2]
        assert all(x["ring_s"] > 0 and x["blocks_s"] > 0 for x in r["ranks"])
        slowest = max(x["ring_s"] for x in r["ranks"])
        assert abs(r["predicted_speedup"] - r["single_s"] / (slowest + r["t_home_s"])) < 1e-9


def test_ring_two_gpus_script_runs_its_cpu_mode(tmp_path):
    """bench/ring_two_gpus.sh (the next two-GPU session's one call) with FH_RING_DEVICE=cpu: the
    example and the scaling script under torchrun over gloo, every step passing, the rows
    written; in its GPU mode on fewer than 2 GPUs it exits 2 saying so."""
    import json

    import torch

    env = {**os.environ, "FH_RING_DEVICE": "cpu", "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "bench" / "ring_two_gpus.sh"), str(tmp_path)],
                            capture_output=True, text=True, timeout=400, env=env, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "ring_two_gpus: PASS" in result.stdout
    assert "causal=True, cpu): done" in (tmp_path / "example.log").read_text()
    rows = json.loads((tmp_path / "ring_scaling.json").read_text())["rows"]
    assert [(r["causal"], r["layout"]) for r in rows] == [(True, "zigzag"), (False, "contiguous")]
    if torch.cuda.device_count() < 2:
        env["FH_RING_DEVICE"] = "cuda"
        result = subprocess.run(["bash", str(ROOT / "bench" / "ring_two_gpus.sh"),
                                 str(tmp_path / "gpu")], capture_output=True, text=True,
                                timeout=120, env=env, check=False)
        assert result.returncode == 2 and "needs 2 GPUs" in result.stdout
