"""The ctypes binding against api.h, library loading, and the C ABI's argument checks (CPU).

The struct/enum tests parse api.h itself, so Python and C cannot drift apart silently. The tests
that call into the library use the ``lib`` fixture (skipped only when it was never built); they
need no GPU: the C side validates its parameters before it touches CUDA.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import flash_hopper
import pytest
from flash_hopper import CudaError, InternalError, LibraryNotFoundError, UnsupportedError, _lib
from flash_hopper._lib import ABI_VERSION, FhBackend, FhDtype, FhFwdParams, FhStatus, FhVariant
from flash_hopper.dispatch import HEAD_DIM_BUCKETS, head_dim_bucket

API_H = Path(__file__).resolve().parents[1] / "kernels" / "include" / "flash_hopper" / "api.h"
C_TYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
# sizeof(FhFwdParams) per ABI version: a layout change without an FH_ABI_VERSION bump is a bug.
SIZEOF_BY_ABI = {1: 376}


def _header() -> str:
    if not API_H.is_file():
        pytest.skip(f"{API_H} not present (tests run outside the source tree)")
    text = re.sub(r"/\*.*?\*/", "", API_H.read_text(), flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _header_fields() -> list[tuple[str, type]]:
    body = re.search(r"typedef struct FhFwdParams \{(.*?)\} FhFwdParams;", _header(), re.DOTALL)
    fields = []
    for decl in body.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        match = re.fullmatch(r"(?:const )?(\w+)\s*(\*?)\s*(.+)", decl)
        base, pointer, names = match.groups()
        for name in names.split(","):
            name = name.strip()
            is_pointer = bool(pointer) or name.startswith("*")
            fields.append((name.lstrip("* "), ctypes.c_void_p if is_pointer else C_TYPES[base]))
    return fields


def _header_enum(name: str) -> dict[str, int]:
    body = re.search(rf"typedef enum {name} \{{(.*?)\}} {name};", _header(), re.DOTALL).group(1)
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(\w+)\s*=\s*(\d+)", body)}


# --- the binding mirrors api.h -------------------------------------------------------------------


def test_struct_fields_match_api_h():
    assert [(n, t) for n, t in FhFwdParams._fields_] == _header_fields()


def test_struct_layout_is_the_c_layout():
    # LP64 C layout: each field at the next multiple of its own size; the struct padded to 8.
    offset = 0
    for name, ctype in _header_fields():
        size = ctypes.sizeof(ctype)
        offset = (offset + size - 1) // size * size
        assert getattr(FhFwdParams, name).offset == offset, name
        offset += size
    assert ctypes.sizeof(FhFwdParams) == (offset + 7) // 8 * 8
    assert ctypes.sizeof(FhFwdParams) == SIZEOF_BY_ABI[ABI_VERSION]
    assert len(FhFwdParams._fields_) == 50


@pytest.mark.parametrize(
    ("enum", "c_name", "prefix"),
    [(FhStatus, "FhStatus", "FH_"), (FhDtype, "FhDtype", "FH_DTYPE_"),
     (FhBackend, "FhBackend", "FH_BACKEND_"), (FhVariant, "FhVariant", "FH_VARIANT_")],
)
def test_enums_match_api_h(enum, c_name, prefix):
    assert {prefix + m.name: int(m) for m in enum} == _header_enum(c_name)


def test_abi_version_matches_api_h():
    assert re.search(r"#define FH_ABI_VERSION (\d+)", _header()).group(1) == str(ABI_VERSION)


def test_every_exported_function_is_bound():
    exported = set(re.findall(r"FH_EXPORT [\w\s\*]+?\b(fh_\w+)\(", _header()))
    bound = set(re.findall(r"d\.(fh_\w+)\.argtypes", Path(_lib.__file__).read_text()))
    assert exported == bound


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (FhStatus.ERROR_INVALID_ARGUMENT, ValueError),
        (FhStatus.ERROR_UNSUPPORTED, UnsupportedError),
        (FhStatus.ERROR_CUDA, CudaError),
        (FhStatus.ERROR_INTERNAL, InternalError),
        (99, InternalError),
    ],
)
def test_status_to_exception(status, kind):
    error = _lib.status_error(status, "fh_fwd: head_dim: expected <= 256, got 512")
    assert type(error) is kind
    assert "head_dim: expected <= 256, got 512" in str(error)
    assert isinstance(_lib.status_error(FhStatus.ERROR_UNSUPPORTED, ""), NotImplementedError)


# --- finding and loading the library -------------------------------------------------------------


@pytest.fixture
def unloaded(monkeypatch):
    """A process state in which no library was loaded yet."""
    monkeypatch.setattr(_lib, "_library", None)
    return monkeypatch


def test_missing_library_says_where_it_looked_and_how_to_build(unloaded, tmp_path):
    missing = tmp_path / "nowhere" / "libflash_hopper.so"
    unloaded.setenv("FLASH_HOPPER_LIB", str(missing))
    with pytest.raises(LibraryNotFoundError) as info:
        _lib.get_library()
    message = str(info.value)
    for fragment in (str(missing), "FLASH_HOPPER_LIB", "pip install", "cmake --build"):
        assert fragment in message
    assert flash_hopper.library_path() is None
    with pytest.raises(LibraryNotFoundError):
        flash_hopper.build_info()


def test_env_var_may_name_a_directory(unloaded, tmp_path):
    unloaded.setenv("FLASH_HOPPER_LIB", str(tmp_path))
    assert _lib.candidate_paths()[0] == tmp_path / "libflash_hopper.so"
    assert _lib.find_library() is None
    (tmp_path / "libflash_hopper.so").write_bytes(b"")
    assert _lib.find_library() == tmp_path / "libflash_hopper.so"
    assert flash_hopper.library_path() == str(tmp_path / "libflash_hopper.so")


def test_a_file_that_is_not_a_library(unloaded, tmp_path):
    bogus = tmp_path / "libflash_hopper.so"
    bogus.write_text("not an ELF file")
    unloaded.setenv("FLASH_HOPPER_LIB", str(bogus))
    with pytest.raises(LibraryNotFoundError, match="could not be loaded"):
        _lib.get_library()


def test_import_needs_no_library(tmp_path):
    env = dict(os.environ, FLASH_HOPPER_LIB=str(tmp_path / "missing.so"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flash_hopper.__file__).parents[1])] + sys.path)
    code = "import flash_hopper, flash_hopper.reference; print(flash_hopper.library_path())"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


# --- the loaded library (built by CI; skipped in a checkout that never built it) -----------------


def test_abi_version_of_the_library(lib):
    assert lib.abi_version == ABI_VERSION


def test_build_info(lib):
    info = flash_hopper.build_info()
    assert info == json.loads(lib._dll.fh_build_info().decode())
    for key in ("version", "commit", "archs", "head_dims", "dtypes"):
        assert key in info, key
    assert set(info["archs"]) <= {"sm80", "sm90a"}
    assert set(info["head_dims"]) <= set(HEAD_DIM_BUCKETS)
    assert set(info["dtypes"]) <= {"fp16", "bf16"}
    assert info["head_dims"] and info["dtypes"]
    if flash_hopper.__version__ != "0+unknown":  # an installed package: same version as the build
        assert info["version"] == flash_hopper.__version__


def test_has_fwd_kernel_agrees_with_build_info(lib):
    info = lib.build_info()
    arch = {FhBackend.FA2: "sm80", FhBackend.FA3: "sm90a"}
    dtypes = {FhDtype.FP16: "fp16", FhDtype.BF16: "bf16"}
    for backend, arch_name in arch.items():
        for dtype, dtype_name in dtypes.items():
            for bucket in HEAD_DIM_BUCKETS:
                listed = (arch_name in info["archs"] and dtype_name in info["dtypes"]
                          and bucket in info["head_dims"])
                assert lib.has_fwd_kernel(backend, dtype, bucket) == listed, (
                    backend, dtype_name, bucket)


def test_library_buckets_head_dims_like_python(lib):
    for backend in (FhBackend.FA2, FhBackend.FA3):
        for dtype in (FhDtype.FP16, FhDtype.BF16):
            for d in range(8, 257, 8):
                assert lib.has_fwd_kernel(backend, dtype, d) == lib.has_fwd_kernel(
                    backend, dtype, head_dim_bucket(d)), (backend, dtype, d)


def _valid_params() -> FhFwdParams:
    """Params fh_fwd would accept up to the device checks.

    The pointers are fake: every test below breaks one field that the C side checks (abi_version,
    dtype, shapes, head_dim, heads, null pointers, reserved fields, in that order) before it
    touches memory or CUDA, so nothing is dereferenced and no GPU is needed.
    """
    b, sq, sk, hq, hkv, d = 2, 128, 128, 8, 2, 128
    p = FhFwdParams()
    p.abi_version = ABI_VERSION
    p.q = p.k = p.v = p.o = 0x10000
    p.dtype = p.out_dtype = FhDtype.BF16
    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv = b, sq, sk, hq, hkv
    p.head_dim = p.head_dim_v = d
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = sq * hq * d, hq * d, d
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = sq * hq * d, hq * d, d
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = sk * hkv * d, hkv * d, d
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = sk * hkv * d, hkv * d, d
    p.lse_batch_stride, p.lse_head_stride = hq * sq, sq
    p.softmax_scale = d**-0.5
    p.window_left = p.window_right = -1
    p.backend = FhBackend.AUTO
    return p


INVALID = {FhStatus.ERROR_INVALID_ARGUMENT}
INVALID_OR_UNSUPPORTED = {FhStatus.ERROR_INVALID_ARGUMENT, FhStatus.ERROR_UNSUPPORTED}
UNSUPPORTED = {FhStatus.ERROR_UNSUPPORTED}


@pytest.mark.parametrize(
    ("fields", "statuses", "names"),
    [
        ({"abi_version": ABI_VERSION + 1}, INVALID_OR_UNSUPPORTED, r"abi_version"),
        ({"dtype": 7}, INVALID, r"dtype"),
        ({"head_dim": 12, "head_dim_v": 12}, INVALID, r"head_dim"),
        ({"head_dim": 264, "head_dim_v": 264}, INVALID_OR_UNSUPPORTED, r"head_dim"),
        ({"heads_q": 6, "heads_kv": 4}, INVALID, r"heads"),
        ({"q": None}, INVALID, r"\bq\b"),
        ({"k": None}, INVALID, r"\bk\b"),
        ({"o": None}, INVALID, r"\bo\b"),
        ({"cu_seqlens_q": 0x10000}, UNSUPPORTED, r"cu_seqlens_q"),
        ({"page_table": 0x10000}, UNSUPPORTED, r"page_table"),
        ({"q_descale": 0x10000}, UNSUPPORTED, r"q_descale"),
        ({"num_splits": 4}, UNSUPPORTED, r"num_splits"),
        ({"variant": 7}, INVALID, r"variant"),
        ({"variant": 1, "backend": FhBackend.FA2}, INVALID, r"variant.*FH_BACKEND_FA3"),
    ],
)
def test_c_abi_rejects_bad_params_naming_the_field(lib, fields, statuses, names):
    params = _valid_params()
    for name, value in fields.items():
        setattr(params, name, value)
    status = lib.fwd_status(params, None)
    assert status in statuses
    assert re.search(names, lib.last_error()), lib.last_error()
    # The checked wrappers raise the mapped exception with the same text.
    kind = ValueError if status == FhStatus.ERROR_INVALID_ARGUMENT else UnsupportedError
    with pytest.raises(kind, match=names):
        lib.fwd(params, None)
    with pytest.raises(kind, match=names):
        lib.select_backend(params)


def test_last_error_is_per_thread(lib):
    params = _valid_params()
    params.q = None
    assert lib.fwd_status(params, None) != FhStatus.SUCCESS
    assert lib.last_error()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(lib.last_error()))
    thread.start()
    thread.join()
    assert seen == [""]
