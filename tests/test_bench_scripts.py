"""The GPU-side scripts in bench/ (run on the GPU machine, not by pytest) at least import and parse
their arguments here, so a refactor of the package cannot break them unnoticed until device time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flash_hopper
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    # The scripts import the same flash_hopper the tests use (installed, or the source tree).
    package_root = str(Path(flash_hopper.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("script", ["ab_libs.py", "sanitizer_case.py", "sass_check.py"])
def test_bench_script_help(script):
    done = _run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_ab_libs_requires_a_library():
    done = _run("ab_libs.py")
    assert done.returncode == 2 and "--lib" in done.stderr
