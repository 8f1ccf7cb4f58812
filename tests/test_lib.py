"""The ctypes binding against api.h, the tables, library loading, and the C ABI's checks (CPU).

The struct/enum tests parse api.h itself and the table tests kernels/src/tables.cmake, so Python
and C cannot drift apart silently. The tests that call into the library use the ``lib`` fixture
(skipped only when it was never built); they need no GPU: the C side validates its parameters
before it touches CUDA, and fh_fwd_select_backend never touches it. Every validation rule has its
own case with the exact status and the message's field, expected and given value.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import flash_hopper
import pytest
import torch
from flash_hopper import (
    CudaError,
    InternalError,
    LibraryNotFoundError,
    UnsupportedError,
    _lib,
    _tables,
)
from flash_hopper._lib import (
    ABI_VERSION,
    FhBackend,
    FhBwdParams,
    FhDecodeParams,
    FhDtype,
    FhFp8Accumulation,
    FhFwdParams,
    FhStatus,
    FhVariant,
    FhVariantFlag,
)
from flash_hopper.dispatch import head_dim_bucket

ROOT = Path(__file__).resolve().parents[1]
API_H = ROOT / "kernels" / "include" / "flash_hopper" / "api.h"
TABLES_CMAKE = ROOT / "kernels" / "src" / "tables.cmake"
C_TYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
# sizeof(FhFwdParams) per ABI version: a layout change without an FH_ABI_VERSION bump is a bug.
# (Version 2 changed fh_fwd_select_backend's signature, version 3 added the backward: neither
# changed the struct, which bench/ab_libs.py relies on to time older libraries.)
SIZEOF_BY_ABI = {1: 376, 2: 376, 3: 376, 4: 408, 5: 416, 6: 456, 7: 480, 8: 480, 9: 480,
                 10: 480, 11: 440, 12: 440}
# sizeof(FhBwdParams) per ABI version (it appeared in 3).
SIZEOF_BWD_BY_ABI = {3: 504, 4: 504, 5: 504, 6: 504, 7: 504, 8: 504, 9: 504, 10: 504, 11: 504,
                     12: 504}
# sizeof(FhDecodeParams) per ABI version (it appeared in 8).
SIZEOF_DECODE_BY_ABI = {8: 336, 9: 328, 10: 336, 11: 336, 12: 408}


def _source(path: Path) -> str:
    if not path.is_file():
        pytest.skip(f"{path} not present (tests run outside the source tree)")
    return path.read_text()


def _header() -> str:
    text = re.sub(r"/\*.*?\*/", "", _source(API_H), flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _header_fields(struct: str = "FhFwdParams") -> list[tuple[str, type]]:
    body = re.search(rf"typedef struct {struct} \{{(.*?)\}} {struct};", _header(), re.DOTALL)
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


def _header_enums() -> dict[str, int]:
    """Every enumerator of api.h with its value; values may be numbers or `A | B` of earlier
    enumerators (FhVariant is written in FhVariantFlag bits)."""
    values: dict[str, int] = {}
    for body in re.findall(r"typedef enum \w+ \{(.*?)\}", _header(), re.DOTALL):
        for name, expr in re.findall(r"(\w+)\s*=\s*([^,]+),", body):
            values[name] = 0
            for term in expr.split("|"):
                term = term.strip()
                values[name] |= int(term) if term.isdigit() else values[term]
    return values


def _header_enum(name: str) -> dict[str, int]:
    body = re.search(rf"typedef enum {name} \{{(.*?)\}} {name};", _header(), re.DOTALL).group(1)
    every = _header_enums()
    return {n: every[n] for n in re.findall(r"(\w+)\s*=", body)}


def _cmake_list(name: str) -> list[str]:
    """The items of `set(<name> ...)` in tables.cmake (quoted or bare, comments dropped)."""
    text = re.sub(r"#[^\n]*", "", _source(TABLES_CMAKE))
    body = re.search(rf"set\({name}\s+(.*?)\)", text, re.DOTALL).group(1)
    return [item.strip('"') for item in body.split()]


# --- the binding mirrors api.h -------------------------------------------------------------------


STRUCTS = [(FhFwdParams, "FhFwdParams", SIZEOF_BY_ABI, 59),
           (FhBwdParams, "FhBwdParams", SIZEOF_BWD_BY_ABI, 66),
           (FhDecodeParams, "FhDecodeParams", SIZEOF_DECODE_BY_ABI, 54)]


@pytest.mark.parametrize(("mirror", "c_name", "sizes", "count"), STRUCTS, ids=["fwd", "bwd", "decode"])
def test_struct_fields_match_api_h(mirror, c_name, sizes, count):
    assert [(n, t) for n, t in mirror._fields_] == _header_fields(c_name)


@pytest.mark.parametrize(("mirror", "c_name", "sizes", "count"), STRUCTS, ids=["fwd", "bwd", "decode"])
def test_struct_layout_is_the_c_layout(mirror, c_name, sizes, count):
    # LP64 C layout: each field at the next multiple of its own size; the struct padded to 8.
    offset = 0
    for name, ctype in _header_fields(c_name):
        size = ctypes.sizeof(ctype)
        offset = (offset + size - 1) // size * size
        assert getattr(mirror, name).offset == offset, name
        offset += size
    assert ctypes.sizeof(mirror) == (offset + 7) // 8 * 8
    assert ctypes.sizeof(mirror) == sizes[ABI_VERSION]
    assert len(mirror._fields_) == count


@pytest.mark.parametrize(
    ("enum", "c_name", "prefix"),
    [(FhStatus, "FhStatus", "FH_"), (FhDtype, "FhDtype", "FH_DTYPE_"),
     (FhBackend, "FhBackend", "FH_BACKEND_"), (FhVariant, "FhVariant", "FH_VARIANT_"),
     (FhVariantFlag, "FhVariantFlag", "FH_VARIANT_FLAG_"),
     (FhFp8Accumulation, "FhFp8Accumulation", "FH_FP8_ACCUM_")],
)
def test_enums_match_api_h(enum, c_name, prefix):
    assert {prefix + m.name: int(m) for m in enum} == _header_enum(c_name)


def test_abi_version_matches_api_h():
    assert re.search(r"#define FH_ABI_VERSION (\d+)", _header()).group(1) == str(ABI_VERSION)


def test_every_exported_function_is_bound():
    exported = set(re.findall(r"FH_EXPORT [\w\s\*]+?\b(fh_\w+)\(", _header()))
    bound = set(re.findall(r"d\.(fh_\w+)\.argtypes", Path(_lib.__file__).read_text()))
    assert exported == bound


def test_library_exports_only_its_c_abi(lib):
    """The dynamic symbol table holds api.h's functions and nothing else of ours: in particular
    the library's own cuTensorMapEncodeTiled (a forward to the driver, launch.cu) stays hidden, so it
    can never interpose on the driver's for another library in the process."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not on PATH")
    listing = subprocess.run([nm, "-D", "--defined-only", str(lib.path)], capture_output=True,
                             text=True, check=True).stdout
    defined = {line.split()[-1] for line in listing.splitlines() if line.strip()}
    exported = set(re.findall(r"FH_EXPORT [\w\s\*]+?\b(fh_\w+)\(", _header()))
    assert exported <= defined
    assert "cuTensorMapEncodeTiled" not in defined
    assert not {name for name in defined if name.startswith("cu")}, sorted(defined)


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


# --- one table per axis: api.h, tables.cmake and _tables.py agree --------------------------------


def test_variant_enumerators_are_named_after_their_flags():
    # FH_VARIANT_NO_PINGPONG_NO_OVERLAP = FLAG_NO_PINGPONG | FLAG_NO_OVERLAP, and so on: the
    # name says which bits are set, in bit order, and every set of flags has its variant.
    for variant in FhVariant:
        flags = [f.name for f in FhVariantFlag if variant & f]
        assert variant.name == ("_".join(flags) if flags else "TUNED")
    assert len(FhVariant) == 2 ** len(FhVariantFlag)


def test_backend_names_derive_from_the_enums():
    assert _tables.BACKEND_NAMES == (
        "auto", "fa2", "fa3", "fa3-no-pingpong", "fa3-no-overlap", "fa3-no-pingpong-no-overlap")
    assert _tables.BACKENDS["fa3-no-overlap"] == (FhBackend.FA3, FhVariant.NO_OVERLAP)
    assert _tables.backend_name(FhBackend.FA3, FhVariant.NO_PINGPONG) == "fa3-no-pingpong"
    assert _tables.backend_name(FhBackend.FA2) == "fa2"


def test_tables_cmake_variant_table_agrees_with_api_h():
    rows = [row.split("|") for row in _cmake_list("FH_FA3_VARIANT_TABLE")]
    assert {name: int(value) for name, value, _ in rows} == {
        name: int(v) for name, v in _tables.FA3_VARIANT_NAMES.items()}
    assert [int(value) for _, value, _ in rows] == list(range(len(rows)))  # row i has value i
    # The serving kernel is the variant without its runtime flags (ping-pong is a kernel argument;
    # overlap a template parameter).
    runtime_flags = FhVariantFlag.NO_PINGPONG
    for _name, value, kernel in rows:
        assert int(kernel) == int(value) & ~runtime_flags


def test_tables_cmake_dtypes_buckets_and_archs_agree_with_python():
    rows = [row.split("|") for row in _cmake_list("FH_DTYPE_TABLE")]
    assert {name: enum for name, enum, *_ in rows} == {
        _tables.dtype_name(d): f"FH_DTYPE_{FhDtype(d).name}" for d in _tables.INPUT_DTYPES.values()}
    # FP8 is the FA-3 forward's only (no FA-2 path, no backward): the table says so.
    paths = {name: where for name, _, _, where, _ in rows}
    assert paths == {"fp16": "all", "bf16": "all", "e4m3": "fwd:90a"}
    assert tuple(int(d) for d in _cmake_list("FH_HEAD_DIM_TABLE")) == _tables.HEAD_DIM_BUCKETS
    rows = [row.split("|") for row in _cmake_list("FH_ARCH_TABLE")]
    assert {f"FH_BACKEND_{b.name}": arch for b, arch in _tables.ARCHS.items()} == {
        backend: (value, name) for value, name, backend in rows}
    for value, name, backend in rows:
        assert _tables.arch_backend(value) == _tables.arch_backend(name) == FhBackend[
            backend.removeprefix("FH_BACKEND_")]


def test_dtype_maps():
    assert _tables.dtype_name(torch.bfloat16) == _tables.dtype_name(FhDtype.BF16) == "bf16"
    assert _tables.DTYPE_NAMES == {"fp16": torch.float16, "bf16": torch.bfloat16,
                                   "e4m3": torch.float8_e4m3fn}
    assert _tables.dtype_name(torch.float8_e4m3fn) == "e4m3"
    assert _tables.arch_backend("sm_90a") == FhBackend.FA3
    assert _tables.arch_backend("sm100") is None


def test_build_info_mismatch_names_what_differs():
    info = {"variants": {n: int(v) for n, v in _tables.FA3_VARIANT_NAMES.items()},
            "head_dim_buckets": list(_tables.HEAD_DIM_BUCKETS), "dtypes": ["bf16"]}
    assert _tables.build_info_mismatch(info) is None
    assert "FA-3 variants" in _tables.build_info_mismatch(dict(info, variants={"fa3": 0}))
    assert "head-dim buckets" in _tables.build_info_mismatch(dict(info, head_dim_buckets=[64]))
    assert _tables.build_info_mismatch(dict(info, dtypes=["bf16", "e4m3"])) is None
    assert "['fp4']" in _tables.build_info_mismatch(dict(info, dtypes=["fp4"]))



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




# --- the loaded library (built by CI; skipped in a checkout that never built it) -----------------


def test_abi_version_of_the_library(lib):
    assert lib.abi_version == ABI_VERSION


def test_a_library_with_other_tables_is_refused(lib, monkeypatch):
    info = lib.build_info()
    monkeypatch.setattr(_lib.Library, "build_info",
                        lambda self: dict(info, head_dim_buckets=[64, 128]))
    with pytest.raises(LibraryNotFoundError, match="head-dim buckets are .64, 128."):
        _lib.Library(lib.path)


def _kernels(info, direction="fwd") -> set[tuple[str, str, int, int]]:
    # Backward entries may carry no variants (the FA-3 ablations have no backward): variant 0.
    return {(k["backend"], k["dtype"], k["head_dim"], v)
            for k in _tables.kernel_entries(info, direction) for v in k.get("variants", [0])}


def test_kernel_entries_read_old_and_new_build_info():
    old = {"kernels": [{"backend": "fa2", "dtype": "bf16", "head_dim": 64, "variants": [0]}]}
    new = {"directions": ["fwd", "bwd"], "backward": True, "kernels": [
        {"backend": "fa2", "direction": "fwd", "dtype": "bf16", "head_dim": 64, "variants": [0]},
        {"backend": "fa2", "direction": "bwd", "dtype": "bf16", "head_dim": 128}]}
    assert _tables.kernel_entries(old) == old["kernels"]
    assert _tables.kernel_entries(old, "bwd") == [] and not _tables.has_backward(old)
    assert [k["head_dim"] for k in _tables.kernel_entries(new)] == [64]
    assert [k["head_dim"] for k in _tables.kernel_entries(new, "bwd")] == [128]
    assert _tables.has_backward(new)


def test_build_info(lib):
    info = flash_hopper.build_info()
    assert info == json.loads(lib._dll.fh_build_info().decode())
    for key in ("version", "commit", "cuda", "archs", "head_dims", "dtypes", "kernels",
                "variants", "head_dim_buckets", "fa3_variants"):
        assert key in info, key
    assert _tables.build_info_mismatch(info) is None
    # A build with no kernels serves nothing: CMake refuses it, and this test would too.
    assert info["archs"] and info["head_dims"] and info["dtypes"] and info["kernels"]
    # The sets are exactly what the kernel list holds.
    kernels = _kernels(info)
    assert {_tables.ARCHS[FhBackend[b.upper()]][1] for b, *_ in kernels} == set(info["archs"])
    assert {d for _, d, _, _ in kernels} == set(info["dtypes"])
    assert {h for _, _, h, _ in kernels} == set(info["head_dims"])
    assert set(info["fa3_variants"]) == {
        _tables.variant_name(v) for b, _, _, v in kernels if b == "fa3" and v}
    assert {v for b, _, _, v in kernels if b == "fa2"} <= {0}  # the FA-2 path has no variants
    # ABI 3: the backward's keys; "backward" says whether any backward kernel was built.
    assert set(info["directions"]) <= set(_tables.DIRECTIONS)
    assert _tables.has_backward(info) == bool(_kernels(info, "bwd"))
    assert ("bwd" in info["directions"]) or not _tables.has_backward(info)
    assert {v for *_, v in _kernels(info, "bwd")} == ({0} if _kernels(info, "bwd") else set())
    if flash_hopper.__version__ != "0+unknown":  # an installed package: same version as the build
        assert info["version"] == flash_hopper.__version__


def _env_list(name: str) -> list[str] | None:
    value = os.environ.get(name, "").strip()
    return [v for v in value.replace(",", ";").split(";") if v] if value else None


@pytest.mark.skipif(os.environ.get("FLASH_HOPPER_REQUIRE_LIB", "") in ("", "0"),
                    reason="CI only: FLASH_HOPPER_REQUIRE_LIB says the FH_* variables built it")
def test_build_info_is_the_requested_build(lib):
    # CI exports the FH_* variables it builds with: the library must hold exactly that set.
    info = lib.build_info()
    archs = _env_list("FH_ARCHS")
    if archs is not None:
        assert set(info["archs"]) == {_tables.ARCHS[_tables.arch_backend(a)][1] for a in archs}
    head_dims = _env_list("FH_HEAD_DIMS")
    if head_dims is not None:
        assert set(info["head_dims"]) == {int(d) for d in head_dims}
    dtypes = _env_list("FH_DTYPES")
    if dtypes is not None:
        assert set(info["dtypes"]) == set(dtypes)


def test_has_fwd_kernel_agrees_with_the_kernel_list(lib):
    kernels = _kernels(lib.build_info())
    for backend in (FhBackend.FA2, FhBackend.FA3):
        for dtype in (FhDtype.FP16, FhDtype.BF16, FhDtype.E4M3):
            for bucket in _tables.HEAD_DIM_BUCKETS:
                listed = (backend.name.lower(), _tables.dtype_name(dtype), bucket, 0) in kernels
                assert lib.has_fwd_kernel(backend, dtype, bucket) == listed, (
                    backend, dtype, bucket)


def test_has_bwd_kernel_agrees_with_the_kernel_list(lib):
    kernels = _kernels(lib.build_info(), "bwd")
    for backend in (FhBackend.FA2, FhBackend.FA3):
        for dtype in (FhDtype.FP16, FhDtype.BF16, FhDtype.E4M3):
            for d in range(8, 257, 8):
                listed = (backend.name.lower(), _tables.dtype_name(dtype), head_dim_bucket(d),
                          0) in kernels
                assert lib.has_bwd_kernel(backend, dtype, d) == listed, (backend, dtype, d)


def test_fp8_kernels_are_the_fa3_forwards_of_the_fp8_buckets(lib):
    # kernels/src/tables.cmake: e4m3 has FA-3 forward kernels in every bucket (as FA3 does),
    # no FA-2 kernel and no backward.
    info = lib.build_info()
    fp8 = {(k["backend"], k["head_dim"]) for k in _tables.kernel_entries(info)
           if k["dtype"] == "e4m3"}
    assert fp8 <= {("fa3", d) for d in (64, 96, 128, 192, 256)}
    assert not [k for k in _tables.kernel_entries(info, "bwd") if k["dtype"] == "e4m3"]
    if "e4m3" in info["dtypes"] and "sm90a" in info["archs"]:
        assert fp8 == {("fa3", d) for d in info["head_dims"]}


def test_library_buckets_head_dims_like_python(lib):
    for backend in (FhBackend.FA2, FhBackend.FA3):
        for dtype in (FhDtype.FP16, FhDtype.BF16):
            for d in range(8, 257, 8):
                assert lib.has_fwd_kernel(backend, dtype, d) == lib.has_fwd_kernel(
                    backend, dtype, head_dim_bucket(d)), (backend, dtype, d)


# --- C ABI validation: one case per rule, exact status, the message names field and values ------


ADDR = 0x10000  # a fake, 16-byte aligned address: nothing below ever dereferences it


def _valid_params() -> FhFwdParams:
    """Params that pass every check (the policy accepts them on any GPU with a kernel)."""
    b, sq, sk, hq, hkv, d = 2, 128, 128, 8, 2, 64
    p = FhFwdParams()
    p.abi_version = ABI_VERSION
    p.q = p.k = p.v = p.o = p.lse = ADDR
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


def _with(**fields) -> FhFwdParams:
    params = _valid_params()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


INVALID, UNSUPPORTED = FhStatus.ERROR_INVALID_ARGUMENT, FhStatus.ERROR_UNSUPPORTED
STRIDES = [f"{t}_{s}_stride" for t in "qkvo" for s in ("batch", "row", "head")]

# (fields, status, message): every rule of validate_fwd.cu's validate() except the data pointers.
SHAPE_RULES = [
    ({"abi_version": ABI_VERSION + 1}, INVALID,
     f"abi_version: expected {ABI_VERSION} (this library's FH_ABI_VERSION), got {ABI_VERSION + 1}"),
    ({"dtype": 7}, INVALID,
     ("dtype: expected FH_DTYPE_FP16 (0, fp16) or FH_DTYPE_BF16 (1, bf16) or FH_DTYPE_E4M3 (2, "
     "e4m3), got 7")),
    ({"dtype": FhDtype.E4M3, "out_dtype": FhDtype.E4M3}, INVALID,
     "out_dtype: expected FH_DTYPE_BF16 (1) or FH_DTYPE_FP16 (0) for e4m3 inputs, got 2"),
    ({"dtype": FhDtype.E4M3, "out_dtype": FhDtype.FP32}, INVALID,
     "out_dtype: expected FH_DTYPE_BF16 (1) or FH_DTYPE_FP16 (0) for e4m3 inputs, got 3"),
    ({"dtype": FhDtype.E4M3, "head_dim": 72, "head_dim_v": 72}, INVALID,
     "head_dim: expected a multiple of 16 for e4m3 inputs (16-byte rows), got 72"),
    ({"dtype": FhDtype.E4M3, "k_row_stride": _valid_params().k_row_stride + 8}, INVALID,
     (f"k_row_stride: expected a multiple of 16 elements for e4m3 inputs (16-byte aligned rows), "
     f"got {_valid_params().k_row_stride + 8}")),
    ({"dtype": FhDtype.E4M3, "fp8_accumulation": 2}, INVALID,
     ("fp8_accumulation: expected FH_FP8_ACCUM_TWO_LEVEL (0) or FH_FP8_ACCUM_SINGLE_LEVEL (1), "
     "got 2")),
    ({"dtype": FhDtype.E4M3, "head_dim": 256, "head_dim_v": 256, "fp8_accumulation": 1}, INVALID,
     ("fp8_accumulation: the single-level ablation exists for head_dim <= 128 (the d192 / "
     "d256 kernels accumulate in two levels only), got head_dim 256")),
    ({"dtype": FhDtype.E4M3, "v_descale_head_stride": -1}, INVALID,
     "v_descale: expected strides >= 0 (0 broadcasts), got batch stride 0, head stride -1"),
    # The mixed mode (bf16 / fp16 q, FP8 k / v): kv_dtype 0 or dtype's means k / v in dtype.
    ({"kv_dtype": FhDtype.FP32}, INVALID,
     ("kv_dtype: expected 0 or 1 (bf16, same as dtype), or FH_DTYPE_E4M3 (2) or FH_DTYPE_E5M2 (4) "
     "with fp16 / bf16 q (the mixed mode), got 3")),
    ({"dtype": FhDtype.E4M3, "out_dtype": FhDtype.BF16, "kv_dtype": FhDtype.E5M2}, INVALID,
     ("kv_dtype: expected 0 or 2 (e4m3, same as dtype), or FH_DTYPE_E4M3 (2) or FH_DTYPE_E5M2 (4) "
     "with fp16 / bf16 q (the mixed mode), got 4")),
    ({"kv_dtype": FhDtype.E4M3, "q_descale": ADDR}, INVALID,
     "q_descale: expected null in the mixed mode (q is bf16, not FP8), got 0x10000"),
    ({"kv_dtype": FhDtype.E5M2, "fp8_accumulation": 1}, INVALID,
     "fp8_accumulation: expected 0 in the mixed mode (its GEMMs are 16-bit), got 1"),
    ({"kv_dtype": FhDtype.E4M3, "head_dim": 72, "head_dim_v": 72}, INVALID,
     "head_dim: expected a multiple of 16 for FP8 k / v (16-byte rows), got 72"),
    ({"kv_dtype": FhDtype.E4M3, "v_row_stride": _valid_params().v_row_stride + 8}, INVALID,
     (f"v_row_stride: expected a multiple of 16 elements for FP8 k / v (16-byte aligned rows), "
     f"got {_valid_params().v_row_stride + 8}")),
    ({"kv_dtype": FhDtype.E4M3, "k_descale_batch_stride": -2}, INVALID,
     "k_descale: expected strides >= 0 (0 broadcasts), got batch stride -2, head stride 0"),
    ({"out_dtype": FhDtype.FP16}, INVALID, "out_dtype: expected 1 (bf16, same as dtype), got 0"),
    ({"out_dtype": FhDtype.FP32}, INVALID, "out_dtype: expected 1 (bf16, same as dtype), got 3"),
    ({"batch": -1}, INVALID, "batch: expected 0..65535, got -1"),
    ({"batch": 65536}, INVALID, "batch: expected 0..65535, got 65536"),
    ({"seqlen_q": -1}, INVALID, "seqlen_q: expected 0..2147483647, got -1"),
    ({"seqlen_k": 2**31}, INVALID, "seqlen_k: expected 0..2147483647, got 2147483648"),
    ({"heads_q": 0}, INVALID, "heads_q: expected 1..65535, got 0"),
    ({"heads_kv": 0}, INVALID, "heads_kv: expected 1..heads_q (8), got 0"),
    ({"heads_kv": 16}, INVALID, "heads_kv: expected 1..heads_q (8), got 16"),  # > heads_q
    ({"heads_q": 6, "heads_kv": 4}, INVALID,
     "heads_kv: expected a divisor of heads_q (6) for GQA/MQA, got 4"),
    ({"head_dim": 12, "head_dim_v": 12}, INVALID,
     "head_dim: expected a multiple of 8 in 8..256, got 12"),
    ({"head_dim": 264, "head_dim_v": 264}, INVALID,
     "head_dim: expected a multiple of 8 in 8..256, got 264"),
    ({"head_dim": 0, "head_dim_v": 0}, INVALID,
     "head_dim: expected a multiple of 8 in 8..256, got 0"),
    ({"head_dim_v": 12}, INVALID, "head_dim_v: expected a multiple of 8 in 8..256, got 12"),
    ({"head_dim_v": 264}, INVALID, "head_dim_v: expected a multiple of 8 in 8..256, got 264"),
    ({"softmax_scale": float("nan")}, INVALID,
     "softmax_scale: expected a finite positive float, got nan"),
    ({"softmax_scale": float("inf")}, INVALID,
     "softmax_scale: expected a finite positive float, got inf"),
    ({"softmax_scale": 0.0}, INVALID, "softmax_scale: expected a finite positive float, got 0"),
    ({"softmax_scale": -0.125}, INVALID,
     "softmax_scale: expected a finite positive float, got -0.125"),
    ({"softcap": -1.0}, INVALID, "softcap: expected a finite float >= 0 (0 = off), got -1"),
    ({"softcap": float("nan")}, INVALID,
     "softcap: expected a finite float >= 0 (0 = off), got nan"),
    ({"softcap": float("inf")}, INVALID,
     "softcap: expected a finite float >= 0 (0 = off), got inf"),
    ({"window_left": -2}, INVALID, "window_left: expected -1 (unbounded) or >= 0, got -2"),
    ({"window_right": -5}, INVALID, "window_right: expected -1 (unbounded) or >= 0, got -5"),
    *[({name: getattr(_valid_params(), name) + 4}, INVALID,
       (f"{name}: expected a multiple of 8 elements (16-byte aligned rows), got "
       f"{getattr(_valid_params(), name) + 4}")) for name in STRIDES],
    ({"cu_seqlens_q": ADDR}, INVALID,
     ("cu_seqlens_q / cu_seqlens_k: expected both (a varlen call; seqused_k without cu_seqlens_k "
     "is the paged KV call, not implemented yet), got cu_seqlens_k null")),
    ({"cu_seqlens_k": ADDR}, INVALID, "cu_seqlens_q / cu_seqlens_k: expected both"),
    ({"seqused_k": ADDR}, INVALID, "cu_seqlens_q / cu_seqlens_k: expected both"),
    ({"cu_seqlens_q": ADDR, "cu_seqlens_k": ADDR}, INVALID,
     "q_batch_stride: expected 0 in a varlen call (packed tensors have no batch axis), got"),
    ({"q_descale": ADDR}, INVALID,
     "q_descale: expected null for bf16 inputs (descales belong to e4m3 inputs), got 0x"),
    ({"k_descale": ADDR}, INVALID, "k_descale: expected null for bf16 inputs"),
    ({"v_descale": ADDR}, INVALID, "v_descale: expected null for bf16 inputs"),
    ({"fp8_accumulation": 1}, INVALID,
     "fp8_accumulation: expected 0 for bf16 inputs (it applies to e4m3 inputs), got 1"),
    ({"backend": 7}, INVALID, "backend: expected FH_BACKEND_AUTO (0), FA2 (1) or FA3 (2), got 7"),
    ({"variant": 4, "backend": FhBackend.FA3}, INVALID,
     "variant: expected an FhVariant 0 (tuned) .. 3 (fa3-no-pingpong-no-overlap), got 4"),
    ({"variant": -1}, INVALID,
     "variant: expected an FhVariant 0 (tuned) .. 3 (fa3-no-pingpong-no-overlap), got -1"),
    ({"variant": 1, "backend": FhBackend.FA2}, INVALID,
     ("variant: 1 (fa3-no-pingpong) is a variant of the fa3 path and needs backend "
     "FH_BACKEND_FA3 (2), got backend 1 (fa2)")),
    ({"variant": 2, "backend": FhBackend.AUTO}, INVALID,
     ("variant: 2 (fa3-no-overlap) is a variant of the fa3 path and needs backend "
     "FH_BACKEND_FA3 (2), got backend 0 (auto)")),
    ({"num_sms": -1}, INVALID, "num_sms: expected 0 (every SM) or a positive cap, got -1"),
    ({"decode_route": 3}, INVALID,
     ("decode_route: expected 0 (the FA paths) or 1 (the decode kernel where it serves the "
      "call), got 3")),
]

# The data pointers: fh_fwd checks them, the policy alone does not read them.
DATA_RULES = [
    *[({name: None}, INVALID, f"{name}: expected a device pointer, got null")
      for name in ("q", "k", "v", "o")],
    *[({name: ADDR + 2}, INVALID, f"{name}: expected a 16-byte aligned pointer, got 0x10002")
      for name in ("q", "k", "v", "o")],
    ({"q": ADDR + 8}, INVALID, "q: expected a 16-byte aligned pointer, got 0x10008"),
    ({"lse": ADDR + 2}, INVALID,
     "lse: expected a 4-byte aligned pointer (float) or null, got 0x10002"),
]


def _rule_id(rule) -> str:
    return ",".join(f"{k}={v}" for k, v in rule[0].items())


@pytest.mark.parametrize(("fields", "status", "message"), SHAPE_RULES + DATA_RULES,
                         ids=[_rule_id(r) for r in SHAPE_RULES + DATA_RULES])
def test_fh_fwd_rejects_each_bad_field(lib, fields, status, message):
    params = _with(**fields)
    assert lib.fwd_status(params, None) == status  # nothing launched: it returned before CUDA
    assert lib.last_error() == message or lib.last_error().startswith(message), lib.last_error()
    kind = ValueError if status == INVALID else UnsupportedError
    with pytest.raises(kind, match=re.escape(message)):  # the checked wrapper: same text
        lib.fwd(params, None)


@pytest.mark.parametrize(("fields", "status", "message"), SHAPE_RULES,
                         ids=[_rule_id(r) for r in SHAPE_RULES])
def test_the_policy_validates_like_fh_fwd(lib, fields, status, message):
    out = ctypes.c_int32(-1)
    got = lib._dll.fh_fwd_select_backend(ctypes.byref(_with(**fields)), 9, 0, ctypes.byref(out),
                                         None, 0)
    assert (got, lib.last_error()[:len(message)]) == (status, message)
    assert out.value == -1  # nothing written on failure


@pytest.mark.parametrize(("fields", "status", "message"), DATA_RULES,
                         ids=[_rule_id(r) for r in DATA_RULES])
def test_the_policy_does_not_read_data_pointers(lib, fields, status, message):
    params = _with(**fields)
    if lib.has_fwd_kernel(FhBackend.FA2, FhDtype.BF16, 64):
        assert lib.policy(params, (8, 0))[0] == FhBackend.FA2
    else:  # a build without that kernel: the answer is about the kernel, not the pointer
        with pytest.raises(UnsupportedError, match="no fa2 kernel for bf16 hdim 64"):
            lib.policy(params, (8, 0))


def test_head_dim_v_without_a_kernel_is_refused_by_the_policy(lib):
    # valid fields (validate_fwd.cu), a pair no kernel serves (policy.cu): unsupported, named
    with pytest.raises(UnsupportedError, match=re.escape(
            "head_dim_v: expected 64 (== head_dim) or a (head_dim, head_dim_v) pair with a kernel "
            "of its own: head_dim 136..192 with head_dim_v 104..128; got (64, 128)")):
        lib.policy(_with(head_dim_v=128), (9, 0))


def test_null_params_and_outputs(lib):
    assert lib._dll.fh_fwd(None, None) == INVALID
    assert lib.last_error() == "params: expected a non-null FhFwdParams pointer, got null"
    st = lib._dll.fh_fwd_select_backend(ctypes.byref(_valid_params()), 9, 0, None, None, 0)
    assert (st, lib.last_error()) == (INVALID, "backend_out: expected a non-null pointer, got null")
    out = ctypes.c_int32()
    st = lib._dll.fh_fwd_select_backend(ctypes.byref(_valid_params()), -1, 0, ctypes.byref(out),
                                        None, 0)
    assert (st, lib.last_error()) == (
        INVALID, "cc_major/cc_minor: expected a compute capability such as 9.0, got -1.0")


def test_nothing_to_compute_needs_no_pointers(lib):
    # batch == 0 or seqlen_q == 0: fh_fwd returns before the device, pointers may be null.
    for fields in ({"batch": 0}, {"seqlen_q": 0}):
        params = _with(q=None, k=None, v=None, o=None, lse=None, **fields)
        assert lib.fwd_status(params, None) == FhStatus.SUCCESS, lib.last_error()
        assert lib.last_error() == ""


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="fh_fwd would launch on a GPU; on CPU it stops at cudaGetDevice")
def test_valid_params_pass_validation_and_fail_at_the_device(lib):
    # Without a GPU a valid call gets as far as the device query: a CUDA status, its message
    # names the runtime call. seqlen_k == 0 lets k and v be null.
    for params in (_valid_params(), _with(seqlen_k=0, k=None, v=None), _with(lse=None)):
        assert lib.fwd_status(params, None) == FhStatus.ERROR_CUDA
        assert lib.last_error().startswith("cudaGetDevice failed: ")
        with pytest.raises(CudaError, match="cudaGetDevice"):
            lib.fwd(params, None)


def test_reason_buffer_is_cut_to_its_length(lib):
    params = _valid_params()
    params.backend = FhBackend.FA2
    if not lib.has_fwd_kernel(FhBackend.FA2, FhDtype.BF16, 64):
        pytest.skip("this build has no fa2 bf16 hdim 64 kernel")
    reason = ctypes.create_string_buffer(b"x" * 16)
    out = ctypes.c_int32()
    st = lib._dll.fh_fwd_select_backend(ctypes.byref(params), 8, 0, ctypes.byref(out), reason, 8)
    assert st == FhStatus.SUCCESS and out.value == FhBackend.FA2
    assert reason.raw[:8] == b"fa2 req\0" and reason.raw[8:16] == b"x" * 8


def test_last_error_is_per_thread(lib):
    params = _valid_params()
    params.q = None
    assert lib.fwd_status(params, None) == INVALID
    assert lib.last_error()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(lib.last_error()))
    thread.start()
    thread.join()
    assert seen == [""]


# --- launch results: the library's own status, never a CUDA code read as a decision -------------

LAUNCH_RESULT_TEST = r"""
#include <cstdio>
#include "src/launch_result.h"
using flash_hopper::LaunchResult;
static void show(const char* kind, LaunchResult r) {
  char msg[512];
  const FhStatus st = flash_hopper::describe_launch(r, "fa2", 256, 65536, msg, sizeof(msg));
  std::printf("%s|%d|%s\n", kind, int(st), msg);
}
int main() {
  show("ok", LaunchResult::ok());
  show("cuda_success", LaunchResult::cuda(cudaSuccess));
  show("no_tile", LaunchResult::no_tile_fits(98304));
  show("layout", LaunchResult::layout_not_loadable("k_row_stride", 1LL << 40));
  // The codes launchers once returned for those two decisions, now genuine CUDA failures:
  show("cuda_config", LaunchResult::cuda(cudaErrorInvalidConfiguration));
  show("cuda_pitch", LaunchResult::cuda(cudaErrorInvalidPitchValue));
  LaunchResult bogus;
  bogus.status = static_cast<flash_hopper::LaunchStatus>(42);
  show("unknown", bogus);
  return 0;
}
"""


def test_launch_results_map_to_their_own_status(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH (the mapping is host code, but needs cuda_runtime.h)")
    source = tmp_path / "launch_result_test.cu"
    source.write_text(LAUNCH_RESULT_TEST)
    exe = tmp_path / "launch_result_test"
    subprocess.run([nvcc, "-std=c++17", f"-I{ROOT / 'kernels'}", f"-I{ROOT / 'kernels/include'}",
                    "-o", str(exe), str(source)], check=True, capture_output=True)
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = {kind: (int(status), msg) for kind, status, msg in
           (line.split("|", 2) for line in lines.splitlines())}
    assert got["ok"] == got["cuda_success"] == (FhStatus.SUCCESS, "")
    assert got["no_tile"] == (UNSUPPORTED, ("head_dim 256: no fa2 tile config fits this GPU's "
                                           "65536 bytes of shared memory per block (the tile "
                                           "needs 98304)"))
    assert got["layout"][0] == UNSUPPORTED
    assert got["layout"][1].startswith("k_row_stride: the fa2 path's TMA needs")
    assert got["layout"][1].endswith("got 1099511627776 elements")
    assert got["cuda_config"] == (FhStatus.ERROR_CUDA, ("kernel launch failed: invalid "
                                  "configuration argument (cudaErrorInvalidConfiguration)"))
    assert got["cuda_pitch"][0] == FhStatus.ERROR_CUDA
    assert "cudaErrorInvalidPitchValue" in got["cuda_pitch"][1]
    assert got["unknown"] == (FhStatus.ERROR_INTERNAL, "launcher returned unknown LaunchStatus 42")
