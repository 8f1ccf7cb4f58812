"""The run-time environment knobs (CPU): one prefix, one table.

Every variable the C library reads (std::getenv in kernels/) and every one the package reads
(the constants of _env.py) is named FLASH_HOPPER_* (LOCAL_RANK is torchrun's) and has a row in
_env.py's docstring; FH_* names are the build's, read by CMake only.
"""

from __future__ import annotations

import re
from pathlib import Path

from flash_hopper import _env

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = {"LOCAL_RANK"}  # set by torchrun, not ours to name


def _table_rows() -> set[str]:
    """The first column of every table in _env's docstring."""
    return set(re.findall(r"^([A-Z][A-Z0-9_]+) ", _env.__doc__, re.MULTILINE))


def _library_reads() -> set[str]:
    names = set()
    for path in (ROOT / "kernels").rglob("*"):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp"):
            names.update(re.findall(r'getenv\("(\w+)"\)', path.read_text()))
    return names


def _package_reads() -> set[str]:
    return {value for name, value in vars(_env).items()
            if name.isupper() and isinstance(value, str)}


def test_library_and_package_knobs_have_one_prefix_and_one_table():
    library, package = _library_reads(), _package_reads()
    assert "FLASH_HOPPER_DEBUG_SMEM_LIMIT" in library and _env.LIBRARY in package  # scans work
    rows = _table_rows()
    for name in sorted(library | package):
        assert name.startswith("FLASH_HOPPER_") or name in FOREIGN, name
        assert name in rows, f"{name} is read but missing from _env.py's table"
