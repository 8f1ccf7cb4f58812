"""Compiles and runs the host test of the FA-3 path's tile scheduler (tests/cpp/).

The scheduler header is plain C++ (no CUDA, no CuTe), so this runs on the CPU-only CI machine and
checks the real code the kernel uses: every tile exactly once for grids of 1, 3 and 132 CTAs,
longest-first masked order, causal load balance.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tile_scheduler_host(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path / "test_tile_scheduler"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{ROOT / 'kernels'}", "-o", str(exe),
                    str(ROOT / "tests" / "cpp" / "test_tile_scheduler.cpp")], check=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")
