"""Compiles tests/cpp/test_bwd_abi.cpp against the built library and runs it (CPU, no GPU).

The backward's C ABI (ABI 3) checked from C++, the way a non-Python caller sees it: workspace
sizes against api.h's documented layout, validation messages, the backend policy over mocked
compute capabilities, fh_has_bwd_kernel against build_info, batch == 0. The library is found like
every C-ABI test finds it (FLASH_HOPPER_LIB, next to the package, the installed copy), but not
loaded through the Python binding: this test must run whatever ABI the binding mirrors. Skipped
only when no library was built, unless FLASH_HOPPER_REQUIRE_LIB=1 (CI), which fails instead.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from flash_hopper import _lib

ROOT = Path(__file__).resolve().parents[1]


def _library_or_skip() -> Path:
    path = _lib.find_library()
    if path is None:
        if os.environ.get("FLASH_HOPPER_REQUIRE_LIB", "") not in ("", "0"):
            pytest.fail("FLASH_HOPPER_REQUIRE_LIB is set but no libflash_hopper.so was found")
        pytest.skip("libflash_hopper.so not built (build it, then set FLASH_HOPPER_LIB)")
    return path


def test_bwd_abi_host(tmp_path):
    library = _library_or_skip()
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path / "test_bwd_abi"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror",
                    f"-I{ROOT / 'kernels' / 'include'}", "-o", str(exe),
                    str(ROOT / "tests" / "cpp" / "test_bwd_abi.cpp"), str(library),
                    f"-Wl,-rpath,{library.parent}"], check=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")
