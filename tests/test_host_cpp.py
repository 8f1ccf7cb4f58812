"""Compiles and runs the host tests of the FA-3 path's plain-C++ headers (tests/cpp/).

The tile scheduler, the step schedule with its role loops, the pipeline ends and the mask policy
are plain C++ (no CUDA, no CuTe), so these run on the CPU-only CI machine against the code the
kernels use:
- test_tile_scheduler.cpp: every tile exactly once for grids of 1, 3 and 132 CTAs, longest-first
  masked order, causal load balance; K / V multicast clusters walking the same heads and key
  blocks with every query block once;
- test_fwd_schedule.cpp: producer, relay (FP8 transposer, mixed-mode converter) and consumer warps
  recorded over random problems and every kernel shape of the tables in sm90/fwd/tile_config.h,
  checked per role (buffers, GEMM hazards, masks, each tile's blocks summed once) and simulated
  against each other with mbarrier and named-barrier semantics, multicast clusters as two CTAs (no
  deadlock, the same steps on all sides, no stage written while read, balanced arrivals), plus
  negative controls that must be caught;
- test_bwd_schedule.cpp: the backward's tile orders (default, deterministic n-descending), each
  tile's steps against the brute-force transpose of the mask, the producer and consumer role
  loops of every built family (sm90/bwd/tile_config.h) simulated together over whole persistent
  grids (a happens-before check of the sdS / sP buffer hazard; the dQ protocol: slots and bulk
  reduce-adds, red.global, the deterministic semaphores with no deadlock, each part once, rank
  order and bitwise-equal sums; every step in the code of its call's softcap), and a negative
  control per property;
- test_fp8_layout.cpp: the FP8 forward's in-place P packing against PTX's fragment layouts and
  the V^T key order, the transposer's addresses (against a plain model of the layouts; also
  against the kernel's own CuTe layouts where CUTLASS and the CUDA headers are found), its
  coverage and shared-memory banks;
- test_varlen_span.cpp: a varlen sequence's spans (varlen.h): FA3's offsets rules, the KV-cache
  entry index and left padding, the clamps that keep unvalidated offsets inside the tensors;
- test_sm80_bwd_fragments.cpp: the FA-2 backward's spelled-out fragment layouts
  (sm80/bwd_fragment_layouts.h) are the very types CuTe derives from the swizzled views;
- test_decode_plan.cpp: the decode kernel's plan (decode_plan.h): each row's keys against a
  brute-force mask, splits covering a range once in balanced whole blocks, page lookups, the
  split heuristic's one-wave bound, the workspace layout.
- test_fp8_widen.cpp: the decode kernel's FP8 widening below sm_89 (fp8_widen.h): every byte pair
  of e4m3 and e5m2 in both halves of a register, against the formats' definitions.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INCLUDES = [f"-I{ROOT / 'kernels'}", f"-I{ROOT / 'kernels' / 'include'}"]


def _compile_and_run(tmp_path: Path, name: str, *args: str, includes: tuple = ()) -> str:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path / name
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", *INCLUDES, *includes, "-o",
                    str(exe), str(ROOT / "tests" / "cpp" / f"{name}.cpp")], check=True)
    result = subprocess.run([str(exe), *args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")
    return result.stdout


def _cute_includes() -> tuple:
    """CUTLASS's headers (the cutlass_library wheel's, as the CMake build takes them) and the
    CUDA toolkit's, as system headers (their warnings are not the test's); () where either is
    missing."""
    try:
        import cutlass_library
    except ImportError:
        return ()
    cutlass = Path(cutlass_library.__file__).parent / "source" / "include"
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    if not (cutlass / "cute" / "tensor.hpp").exists() or not (cuda / "cuda_runtime_api.h").exists():
        return ()
    dirs = [cutlass, cuda] + ([cuda / "cccl"] if (cuda / "cccl").is_dir() else [])
    return tuple(f"-isystem{d}" for d in dirs)


def test_tile_scheduler_host(tmp_path):
    _compile_and_run(tmp_path, "test_tile_scheduler")


def test_fwd_schedule_host(tmp_path):
    # 200 random problems per kernel shape: ~10 s.
    _compile_and_run(tmp_path, "test_fwd_schedule", "200")


def test_bwd_schedule_host(tmp_path):
    # 300 random problems per built family, each on its grid and on a deterministic one: ~2 s.
    _compile_and_run(tmp_path, "test_bwd_schedule", "300")


def test_fp8_layout_host(tmp_path):
    _compile_and_run(tmp_path, "test_fp8_layout")


def test_fp8_sequential_tables_host(tmp_path):
    # The tile table of FH_FP8_SEQUENTIAL=ON builds (FP8 d64 / d128 sequential, wider): the
    # schedule simulation and the transposer's plan over its shapes.
    define = ("-DFH_FP8_SEQUENTIAL=1",)
    _compile_and_run(tmp_path, "test_fwd_schedule", "50", includes=define)
    _compile_and_run(tmp_path, "test_fp8_layout", includes=define)


def _required_cute_includes() -> tuple:
    """_cute_includes(), or a skip when this machine lacks CUTLASS or the CUDA headers."""
    includes = _cute_includes()
    if not includes:
        pytest.skip("CUTLASS (cutlass_library) or the CUDA headers not found")
    return includes


def test_fp8_layout_cute_host(tmp_path):
    # The transposer's addresses against the kernel's own CuTe layouts (fwd/kernel_traits.h), every
    # FP8 head dim: needs CUTLASS and the CUDA headers, which the CPU-only CI machine may lack.
    out = _compile_and_run(tmp_path, "test_fp8_layout", includes=_required_cute_includes())
    assert "against the kernel's CuTe layouts" in out


def test_sm80_bwd_fragments_cute_host(tmp_path):
    # The FA-2 backward's spelled-out register-fragment and accumulator layouts
    # (sm80/bwd_fragment_layouts.h, BwdTraits::AccLayout*) against CuTe's derivation from the
    # swizzled views, every head dim, bf16 / fp16, tuned / fallback: static_asserts, so a drifted
    # entry fails the compile. Needs CUTLASS and the CUDA headers; ~20 s.
    out = _compile_and_run(tmp_path, "test_sm80_bwd_fragments", includes=_required_cute_includes())
    assert "equal CuTe's derivation" in out


def test_varlen_span_host(tmp_path):
    _compile_and_run(tmp_path, "test_varlen_span")


def test_decode_plan_host(tmp_path):
    # The decode kernel's rows, key ranges, splits, page lookups and workspace (decode_plan.h).
    _compile_and_run(tmp_path, "test_decode_plan")


def test_fp8_widen_host(tmp_path):
    _compile_and_run(tmp_path, "test_fp8_widen")
