"""The GPU-side scripts in bench/ (run on the GPU machine, not by pytest) at least import and parse
their arguments here, so a refactor of the package cannot break them unnoticed until device time;
the parts of their logic that need no GPU run here too: ab_libs' per-library check on a poisoned
buffer, and gpu_check.sh's failure handling with the GPU tools replaced by recording stand-ins."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import flash_hopper
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    # The scripts import the same flash_hopper the tests use (installed, or the source tree).
    package_root = str(Path(flash_hopper.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("script", ["ab_libs.py", "sanitizer_case.py", "sass_check.py",
                                    "host_path.py", "varlen_speed.py", "varlen_bwd_speed.py",
                                    "ncu_fwd_peers.py"])
def test_bench_script_help(script):
    done = _run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_ab_libs_requires_a_library():
    done = _run("ab_libs.py")
    assert done.returncode == 2 and "--lib" in done.stderr


def test_ab_libs_refuses_an_unknown_variant_naming_it():
    # NAME=PATH@VARIANT: the variant is checked before the library is loaded
    done = _run("ab_libs.py", "--lib", "a=/nonexistent.so@fa3-no-such-thing")
    assert done.returncode != 0
    assert "fa3-no-such-thing" in done.stderr and "fa3-no-pingpong" in done.stderr


def test_ab_libs_refuses_an_unknown_peer_naming_it():
    # checked before any library is loaded
    done = _run("ab_libs.py", "--lib", "a=/nonexistent.so", "--peer", "no-such-peer")
    assert done.returncode != 0
    assert "no-such-peer" in done.stderr and "flash-attn3" in done.stderr


def test_ab_libs_refuses_a_peer_for_the_backward():
    done = _run("ab_libs.py", "--lib", "a=/nonexistent.so", "--direction", "bwd",
                "--peer", "flash-attn3")
    assert done.returncode != 0 and "backward" in done.stderr


# ---- ab_libs: every library checked against the reference, on a poisoned buffer ------------------


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_libs_variants_set_the_field_they_name():
    from flash_hopper import _abi, _lib
    from flash_hopper._tables import FA3_VARIANT_NAMES

    ab_libs = _load_script("ab_libs")
    params = _lib.FhFwdParams()
    assert ab_libs.with_variant(params, None) is params
    single = ab_libs.with_variant(params, ab_libs.FP8_SINGLE_LEVEL)
    assert single.fp8_accumulation == _abi.FhFp8Accumulation.SINGLE_LEVEL
    assert single.variant == params.variant and params.fp8_accumulation != single.fp8_accumulation
    no_pp = ab_libs.with_variant(params, int(FA3_VARIANT_NAMES["fa3-no-pingpong"]))
    assert no_pp.variant == FA3_VARIANT_NAMES["fa3-no-pingpong"]
    assert no_pp.fp8_accumulation == params.fp8_accumulation


def test_ab_libs_refuses_the_fp8_ablation_for_the_backward():
    done = _run("ab_libs.py", "--lib", "a=/nonexistent.so@fp8-single-level", "--direction", "bwd")
    assert done.returncode != 0 and "fp8-single-level" in done.stderr


def test_ab_libs_checks_each_library_on_a_poisoned_buffer():
    from flash_hopper.bench.cases import Case
    from flash_hopper.bench.check import References
    from flash_hopper.reference import attention_ref

    ab_libs = _load_script("ab_libs")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 4, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    case = Case(batch=2, seqlen_q=40, seqlen_k=40, heads=4, heads_kv=4, head_dim=16, causal=True)
    good_out = attention_ref(q, k, v, causal=True, upcast=False)[0]
    good_lse = attention_ref(q, k, v, causal=True)[1]  # the kernels' LSE is fp32-accurate
    out, lse = torch.empty_like(q), torch.empty(2, 4, 40)

    def good():
        out.copy_(good_out)
        lse.copy_(good_lse)

    def wrong_lse():
        good()
        lse.add_(1e-2)

    runs = {"good": good, "writes-nothing": lambda: None, "wrong-lse": wrong_lse,
            "zeros": lambda: (out.zero_(), lse.zero_())}
    results, outputs = ab_libs.check_libraries(runs, out, lse, References(q, k, v, case))
    # "writes-nothing" runs right after "good" left a correct result in the shared buffer.
    assert {name: r.passed for name, r in results.items()} == {
        "good": True, "writes-nothing": False, "wrong-lse": False, "zeros": False}
    assert outputs["writes-nothing"].isnan().all()
    assert torch.equal(outputs["good"], good_out)


def test_ab_libs_checks_each_backward_on_poisoned_gradients():
    from flash_hopper.bench.cases import Case
    from flash_hopper.bench.check import GradReferences, References
    from flash_hopper.reference import attention_bwd_ref

    ab_libs = _load_script("ab_libs")
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 24, 2, 16, generator=gen).to(torch.bfloat16)
                     for _ in range(4))
    case = Case(batch=1, seqlen_q=24, seqlen_k=24, heads=2, heads_kv=2, head_dim=16, causal=True)
    forward = References(q, k, v, case)
    refs = GradReferences(q, k, v, dout, case, forward)
    good = [g.to(torch.bfloat16) for g in attention_bwd_ref(
        q, k, v, forward.out, forward.lse, dout, causal=True)]
    grads = tuple(torch.empty_like(t) for t in (q, k, v))

    def write(values):
        for g, x in zip(grads, values):
            g.copy_(x)

    def wrong_dk():
        write(good)
        grads[1].mul_(1.5)

    runs = {"good": lambda: write(good), "writes-nothing": lambda: None, "wrong-dk": wrong_dk}
    results, outputs = ab_libs.check_libraries_bwd(runs, grads, refs)
    # "writes-nothing" runs right after "good" left correct gradients in the shared buffers.
    assert {name: r.passed for name, r in results.items()} == {
        "good": True, "writes-nothing": False, "wrong-dk": False}
    assert all(g.isnan().all() for g in outputs["writes-nothing"])
    assert results["wrong-dk"].err["dq"] <= results["wrong-dk"].tol["dq"]


def test_sass_check_flags_serialized_wgmmas():
    # ptxas fences every HGMMA of a kernel whose wgmmas it serialized (one WARPGROUP.ARRIVE each;
    # measured on a d128 backward built with a run-time branch around a wgmma: 64 / 64, against
    # 10 arrives for 64 HGMMAs normally).
    sass_check = _load_script("sass_check")
    assert sass_check.serialized({"HGMMA": 64, "QGMMA": 0, "WARPGROUP.ARRIVE": 64})
    assert not sass_check.serialized({"HGMMA": 64, "QGMMA": 0, "WARPGROUP.ARRIVE": 10})
    assert not sass_check.serialized({"HGMMA": 0, "QGMMA": 0, "WARPGROUP.ARRIVE": 0})
    # FP8 kernels run QGMMA (measured: 32 QGMMA, 8 arrives in the d128 e4m3 forward)
    assert not sass_check.serialized({"HGMMA": 0, "QGMMA": 32, "WARPGROUP.ARRIVE": 8})
    assert sass_check.serialized({"HGMMA": 0, "QGMMA": 32, "WARPGROUP.ARRIVE": 32})
    assert sass_check.wgmmas({"HGMMA": 0, "QGMMA": 32}) == 32


# ---- gpu_check.sh: with the GPU tools replaced by recording stand-ins ---------------------------


FAKE_TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") REQUIRE_LIB=${FLASH_HOPPER_REQUIRE_LIB:-unset} $*" >> "$FAKE_RECORD"
if [[ -n "${FAKE_FAIL:-}" && "$(basename "$0") $*" == *"$FAKE_FAIL"* ]]; then
  echo "failing on purpose: $FAKE_FAIL"
  exit 3
fi
echo "ok"
"""


def _run_pre_merge_script(tmp_path, fail="", tools=("nvidia-smi", "compute-sanitizer", "python"),
                          script="gpu_check.sh"):
    """Run a bench/ GPU script (gpu_check.sh) with stand-ins for the GPU tools and the
    interpreter; each records its arguments and fails when its command line contains ``fail``.
    Returns (result, recorded lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        path = bin_dir / tool
        path.write_text(FAKE_TOOL)
        path.chmod(0o755)
    record = tmp_path / "record.txt"
    record.write_text("")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
           "PYTHON": str(bin_dir / "python"), "FAKE_RECORD": str(record), "FAKE_FAIL": fail,
           "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "bench" / script)], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    return done, record.read_text().splitlines()


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
def test_pre_merge_script_runs_every_step_with_the_library_required(tmp_path):
    done, calls = _run_pre_merge_script(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu_check: PASS" in done.stdout
    python_calls = [c for c in calls if c.startswith("python ")]
    assert python_calls and all("REQUIRE_LIB=1" in c for c in python_calls)
    assert any("-m pytest" in c for c in python_calls)
    assert any("-m flash_hopper bench" in c for c in python_calls)
    sanitizer = [c for c in calls if c.startswith("compute-sanitizer")]
    for backend in ("fa2", "fa3"):
        for tool in ("memcheck", "racecheck", "synccheck"):
            assert any(f"--tool {tool}" in c and f"--backend {backend}" in c
                       and "--direction bwd" not in c for c in sanitizer)
    # The backward's cases on both paths (each on the buckets it has a backward for).
    for backend in ("fa2", "fa3"):
        for tool in ("memcheck", "racecheck", "synccheck"):
            assert any(f"--tool {tool}" in c and f"--backend {backend}" in c
                       and "--direction bwd" in c for c in sanitizer)
    # The serving paths' hazard tests under memcheck (value checks off inside the tests).
    assert any("--tool memcheck" in c and "test_decode_gpu.py" in c and "test_varlen_gpu.py" in c
               and "unchecked" in c for c in sanitizer)
    # The API fuzz, alone and under memcheck.
    assert any("tests/fuzz_api.py --seconds 120" in c for c in python_calls)
    assert any("--tool memcheck" in c and "tests/fuzz_api.py --small" in c for c in sanitizer)
    logs = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"pytest.log", "bench.log", "build_info.json", "sanitizer_synccheck_fa3.log",
            "sanitizer_racecheck_bwd_fa2.log", "fuzz.log", "fuzz_memcheck.log",
            "sanitizer_memcheck_serving.log"} <= logs


@needs_bash
@pytest.mark.parametrize("fail,steps", [
    ("-m pytest", ["pytest", "compute-sanitizer memcheck (serving hazards)"]),
    ("--tool racecheck", ["compute-sanitizer racecheck (fa2)", "compute-sanitizer racecheck (fa3)",
                          "compute-sanitizer racecheck bwd (fa2)",
                          "compute-sanitizer racecheck bwd (fa3)"]),
    ("--direction bwd", [f"compute-sanitizer {t} bwd ({b})" for b in ("fa2", "fa3")
                         for t in ("memcheck", "racecheck", "synccheck")]),
    ("--backend fa3", [f"compute-sanitizer {t}{d} (fa3)" for d in ("", " bwd")
                       for t in ("memcheck", "racecheck", "synccheck")]),
    ("fuzz_api.py", ["API fuzz", "API fuzz under memcheck"]),
    ("build_info", ["build info"]),
    ("nvidia-smi", ["nvidia-smi"]),
    ("--head-dim 64 128", ["quick benchmark"]),
])
def test_pre_merge_script_fails_when_any_step_fails(tmp_path, fail, steps):
    done, calls = _run_pre_merge_script(tmp_path, fail=fail)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = done.stdout.split("gpu_check: FAIL", 1)[1].splitlines()[1:]
    assert summary == [f"  {step}" for step in steps]
    # The other steps still ran: one run shows every problem.
    assert any("-m flash_hopper bench" in c for c in calls)
    assert any("--tool synccheck" in c for c in calls)


@needs_bash
def test_pre_merge_script_fails_without_the_sanitizer(tmp_path):
    done, _ = _run_pre_merge_script(tmp_path, tools=("nvidia-smi", "python"))
    assert done.returncode == 1
    assert "compute-sanitizer memcheck (fa2)" in done.stdout.split("gpu_check: FAIL", 1)[1]


# ---- serving_check.sh: the short serving-hazard run for a device lease ------------------------


@needs_bash
def test_serving_check_runs_every_step_and_fails_when_one_fails(tmp_path):
    done, calls = _run_pre_merge_script(tmp_path, script="serving_check.sh")
    assert done.returncode == 0, done.stdout + done.stderr
    assert all("REQUIRE_LIB=1" in c for c in calls if c.startswith("python "))
    sanitizer = [c for c in calls if c.startswith("compute-sanitizer")]
    assert any("test_decode_gpu.py" in c and "unchecked" in c for c in sanitizer)
    assert any("fuzz_api.py --small --kinds hazard" in c for c in sanitizer)
    assert any("fuzz_api.py --kinds hazard" in c for c in calls if c.startswith("python "))
    done, _ = _run_pre_merge_script(tmp_path, fail="--kinds hazard --seconds 50",
                                    script="serving_check.sh")
    assert done.returncode == 1
    assert "fuzz (hazard) rc=3" in done.stdout


def test_ab_libs_peers_are_checked_and_skipped_by_reason():
    from flash_hopper.bench.cases import Case
    from flash_hopper.bench.check import References
    from flash_hopper.reference import attention_ref

    ab_libs = _load_script("ab_libs")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    case = Case(batch=1, seqlen_q=32, seqlen_k=32, heads=2, heads_kv=2, head_dim=16, causal=False)
    good_out, good_lse = attention_ref(q, k, v, upcast=False)[0], attention_ref(q, k, v)[1]

    class Peer:
        def __init__(self, out, lse, reason=None):
            self.result, self.reason, self.calls = (out, lse), reason, 0

        def software_reason(self):
            return None

        def unsupported(self, case, direction=None):
            return self.reason

        def fp8_reason(self):
            return None

        def run_checked(self, q, k, v, case):
            return self.result

        def make_forward(self, q, k, v, case):
            def run():
                self.calls += 1
            return run

    peers = {"right": Peer(good_out, good_lse), "lse-off": Peer(good_out, good_lse + 1e-2),
             "out-off": Peer(good_out + 0.5, None), "cannot": Peer(None, None, "no such mask")}
    out, lse = torch.empty_like(q), torch.empty(1, 2, 32)
    runs, checks, outs, skipped = ab_libs.peer_runs(peers, q, k, v, case, (), out, lse,
                                                    References(q, k, v, case))
    assert skipped == {"cannot": "no such mask"}
    assert {n: c.passed for n, c in checks.items()} == {
        "right": True, "lse-off": False, "out-off": False}
    assert set(runs) == set(outs) == {"right", "lse-off", "out-off"}
    runs["right"]()
    assert peers["right"].calls == 1


def test_ncu_fwd_peers_names_an_unknown_backend():
    done = _run("ncu_fwd_peers.py", "--backend", "nope")
    assert done.returncode != 0
    assert "--backend: expected flash-hopper, flash-attn3 or flash-attn-cute, got 'nope'" in (
        done.stderr + done.stdout)
