"""Shared test setup.

- Tests marked ``gpu`` are skipped when torch sees no CUDA device.
- The ``lib`` fixture yields the loaded kernel library, or skips the test with the loader's
  message when there is none (a CPU-only checkout that never built it). CI builds the library:
  set FLASH_HOPPER_REQUIRE_LIB=1 there so a missing library fails these tests instead of
  skipping them silently.
- ``exact_fp32_matmuls`` turns TF32 off for a test (the GPU modules' references must be fp32).
- Without an installed package, the source tree's python/ is put on sys.path; tests/ too, for
  the shared _helpers module.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parent
if importlib.util.find_spec("flash_hopper") is None:
    sys.path.insert(0, str(_TESTS.parent / "python"))
if str(_TESTS) not in sys.path:  # _helpers.py, also under --import-mode=importlib
    sys.path.insert(0, str(_TESTS))

from flash_hopper import _lib


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def load_library_or_skip() -> _lib.Library:
    """The kernel library; skips (or fails under FLASH_HOPPER_REQUIRE_LIB=1) when absent."""
    try:
        return _lib.get_library()
    except _lib.LibraryNotFoundError as e:
        if os.environ.get("FLASH_HOPPER_REQUIRE_LIB", "") not in ("", "0"):
            pytest.fail(f"FLASH_HOPPER_REQUIRE_LIB is set but the library is missing: {e}")
        first_line = str(e).splitlines()[0]
        pytest.skip(f"{first_line} (build it, then set FLASH_HOPPER_LIB or pip install .)")


@pytest.fixture
def lib() -> _lib.Library:
    return load_library_or_skip()


@pytest.fixture
def exact_fp32_matmuls():
    """fp32 matmuls stay fp32 (not TF32) for the test: references must be what they say."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.fixture
def seed(request) -> int:
    """A per-test seed (stable across runs, different between tests), applied to torch."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value
