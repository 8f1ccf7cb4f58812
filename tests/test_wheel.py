"""The wheel's promises on CPU: the library loads on glibc >= 2.28 and needs only glibc
(tools/check_wheel.py, with negative controls), the private glibc definitions of the manylinux link
work (tools/manylinux/glibc_compat.cpp), the flavour rename (tools/wheel_flavour.py) and the
driver-too-old message of the C ABI.

CI builds the library with FH_MANYLINUX=1, so there the installed library must pass the same
check the release wheels pass; a native development build (link "native") skips that test.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from flash_hopper import CudaError, _lib

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"fh_tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_wheel = _load_tool("check_wheel")
wheel_flavour = _load_tool("wheel_flavour")

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("readelf") is None,
                               reason="needs g++ and readelf (binutils)")
linux_x86_64 = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                  reason="the manylinux link is x86_64 Linux only")


def _glibc() -> tuple[int, ...]:
    name = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""
    return tuple(int(x) for x in name.split()[-1].split(".")) if name else (0,)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "on", "true", "yes")


# --- the installed library ---------------------------------------------------------------------

@linux_x86_64
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_library_needs_only_glibc_2_28(lib):
    info = lib.build_info()
    if info.get("link") != "manylinux_2_28":
        if _truthy("FH_MANYLINUX"):
            pytest.fail(f"FH_MANYLINUX is set but the library's link is {info.get('link')!r}")
        pytest.skip(f"library linked {info.get('link')!r} (FH_MANYLINUX=1 builds the wheel link)")
    report = check_wheel.elf_report(lib.path)
    assert check_wheel.elf_problems(report, "2.28") == []
    # exactly api.h's functions (the C ABI), nothing else
    header = (ROOT / "kernels" / "include" / "flash_hopper" / "api.h").read_text()
    declared = set(re.findall(r"FH_EXPORT [\w\s\*]+?\b(fh_\w+)\(", header))
    assert {"fh_fwd", "fh_bwd", "fh_debug_set_timeline"} <= declared
    assert set(report.exports) == declared


def test_build_info_names_the_cuda_and_gpu_code(lib):
    info = lib.build_info()
    assert info["link"] in ("native", "manylinux_2_28")
    assert int(str(info["cuda"]).split(".")[0]) >= 12
    expected = set()
    if "sm80" in info["archs"]:
        expected |= {"sm_80", "sm_90", "compute_80"}  # compute_80: PTX for later GPUs to JIT
    if "sm90a" in info["archs"]:
        expected.add("sm_90a")
    assert set(info["gpu_code"]) == expected


def _no_driver() -> bool:
    return not Path("/proc/driver/nvidia/version").exists()


@pytest.mark.skipif(not _no_driver(), reason="an NVIDIA driver is installed here")
def test_without_a_driver_the_message_names_the_driver_needed(lib):
    from test_lib import _valid_params

    major = int(str(lib.build_info()["cuda"]).split(".")[0])
    needed = ">= 580" if major >= 13 else ">= 525.60.13"
    with pytest.raises(CudaError) as err:
        lib.fwd(_valid_params(), None)
    text = str(err.value)
    assert "no NVIDIA driver was found" in text, text
    assert f"built with CUDA {major}." in text and f"needs an NVIDIA driver {needed}" in text, text
    assert "\n" not in text  # one sentence, one line


# --- the checker, with negative controls -------------------------------------------------------

def _compile_so(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.cpp"
    src.write_text(textwrap.dedent(source))
    out = tmp_path / f"{name}.so"
    subprocess.run(["g++", "-std=c++17", "-O2", "-fPIC", "-shared", "-o", str(out), str(src),
                    *flags], check=True, capture_output=True, text=True)
    return out


@needs_gxx
@linux_x86_64
@pytest.mark.skipif(_glibc() < (2, 34), reason="needs a glibc >= 2.34 build machine")
def test_checker_flags_new_glibc_symbols_dependencies_and_exports(tmp_path):
    # Linked natively against glibc >= 2.34 with a shared libstdc++: pthread_create binds to
    # GLIBC_2.34, libstdc++.so.6 is needed, and the C++ function is exported.
    so = _compile_so(tmp_path, "native", """
        #include <pthread.h>
        #include <string>
        static void* run(void*) { return nullptr; }
        int spawn() { pthread_t t; return pthread_create(&t, nullptr, run, nullptr); }
        std::string name() { return std::string(40, 'x'); }
        extern "C" int fh_ok() { return spawn() + int(name().size()); }
    """, "-lpthread")
    report = check_wheel.elf_report(so)
    problems = " | ".join(check_wheel.elf_problems(report, "2.28"))
    assert "GLIBC_2.34" in problems and "newer than glibc 2.28" in problems, problems
    assert "libstdc++.so.6" in problems, problems
    assert "exports symbols besides the C ABI" in problems and "_Z5spawnv" in problems, problems
    assert check_wheel.newest_glibc(report) != "none"


@needs_gxx
@linux_x86_64
def test_checker_accepts_a_glibc_only_library(tmp_path):
    so = _compile_so(tmp_path, "plain", """
        #include <cstring>
        extern "C" __attribute__((visibility("default"))) int fh_len(const char* s) {
          return int(std::strlen(s));
        }
    """, "-fvisibility=hidden", "-static-libstdc++", "-static-libgcc")
    report = check_wheel.elf_report(so)
    assert report.exports == ["fh_len"]
    assert check_wheel.elf_problems(report, "2.28") == []


# --- the private glibc definitions of the manylinux link ---------------------------------------

_PROBE = """
    #include <random>
    #include <stdexcept>
    #include <string>
    namespace {
    [[gnu::noinline]] int thrower(int x) {
      if (x > 0) { throw std::runtime_error("probe " + std::to_string(x)); }
      return x;
    }
    }  // namespace
    // An exception thrown and caught inside the library: libgcc's unwinder looks the frames up
    // through _dl_find_object.
    extern "C" __attribute__((visibility("default"))) int probe_unwind(int x) {
      try {
        return thrower(x);
      } catch (const std::exception& e) {
        return 1000 + int(std::string(e.what()).size());
      }
    }
    // std::random_device("default") reads arc4random where glibc has it.
    extern "C" __attribute__((visibility("default"))) unsigned probe_random() {
      std::random_device rd("default");
      return rd() | 1u;
    }
"""

_RUN_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
print(lib.probe_unwind(5), lib.probe_unwind(-3), lib.probe_random() & 1)
"""


def _link_probe(tmp_path: Path, compat: Path, name: str) -> Path:
    probe = tmp_path / "probe.cpp"
    probe.write_text(textwrap.dedent(_PROBE))
    out = tmp_path / f"{name}.so"
    # The library's own link: static libstdc++/libgcc, every symbol defined (-z defs).
    subprocess.run(["g++", "-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-shared",
                    "-static-libstdc++", "-static-libgcc", "-Wl,-z,defs", "-o", str(out),
                    str(probe), str(compat), "-ldl"], check=True, capture_output=True, text=True)
    return out


def _run_probe(so: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN_PROBE, str(so)], capture_output=True,
                          text=True, timeout=60, check=False)


@needs_gxx
@linux_x86_64
def test_compat_definitions_unwind_and_draw_random_numbers(tmp_path):
    so = _link_probe(tmp_path, TOOLS / "manylinux" / "glibc_compat.cpp", "probe")
    run = _run_probe(so)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1007", "-3", "1"]
    # The library keeps its own definitions: none of them is exported.
    exports = check_wheel.elf_report(so).exports
    assert not {"_dl_find_object", "arc4random", "__libc_single_threaded"} & set(exports)


@needs_gxx
@linux_x86_64
@pytest.mark.skipif(_glibc() < (2, 35), reason="libgcc calls _dl_find_object from glibc 2.35 on")
def test_a_broken_dl_find_object_breaks_unwinding(tmp_path):
    # Negative control: the probe's exceptions really go through the compat _dl_find_object.
    broken = tmp_path / "broken_compat.cpp"
    broken.write_text(textwrap.dedent("""
        #include <dlfcn.h>
        extern "C" {
        __attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
        __attribute__((visibility("hidden"))) int _dl_find_object(void*, dl_find_object*) noexcept {
          return -1;
        }
        }
    """))
    run = _run_probe(_link_probe(tmp_path, broken, "broken"))
    assert run.returncode != 0 and "1007" not in run.stdout


# --- the flavour rename ------------------------------------------------------------------------

def _fake_wheel(path: Path) -> None:
    info = "flash_hopper-0.1.0.dist-info"
    files = {
        "flash_hopper/__init__.py": b"",
        "flash_hopper/libflash_hopper.so": b"\x7fELF-not-really",
        f"{info}/METADATA": b"Metadata-Version: 2.2\nName: flash-hopper\nVersion: 0.1.0\n\nbody\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nTag: py3-none-manylinux_2_28_x86_64\n",
        f"{info}/entry_points.txt": b"[console_scripts]\nflash-hopper = flash_hopper.cli:main\n",
        f"{info}/RECORD": b"stale\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            entry.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            z.writestr(entry, data)


def test_wheel_flavour_renames_the_distribution_only(tmp_path):
    src = tmp_path / "flash_hopper-0.1.0-py3-none-manylinux_2_28_x86_64.whl"
    _fake_wheel(src)
    out = wheel_flavour.rename(src, "flash-hopper-cu12", tmp_path / "out")
    assert out.name == "flash_hopper_cu12-0.1.0-py3-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        info = "flash_hopper_cu12-0.1.0.dist-info"
        assert {"flash_hopper/__init__.py", "flash_hopper/libflash_hopper.so", f"{info}/METADATA",
                f"{info}/WHEEL", f"{info}/entry_points.txt", f"{info}/RECORD"} == names
        assert "Name: flash-hopper-cu12\n" in z.read(f"{info}/METADATA").decode()
        assert z.getinfo("flash_hopper/libflash_hopper.so").external_attr >> 16 == 0o755
        record = z.read(f"{info}/RECORD").decode().splitlines()
        assert f"{info}/RECORD,," in record
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            if path.endswith("RECORD"):
                continue
            data = z.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected.decode() and int(size) == len(data), path


def test_the_package_finds_a_renamed_distribution():
    # The import package is the same whichever flavour installed it.
    assert _lib.DISTRIBUTIONS == ("flash-hopper", "flash-hopper-cu13", "flash-hopper-cu12")
    name = _lib.installed_distribution()
    assert name is None or name in _lib.DISTRIBUTIONS


# --- aarch64 (cross-built wheels for Grace-Hopper hosts) ------------------------------------------


def test_aarch64_wheel_names_and_glibc_libraries():
    # the aarch64 wheel's tag and the dynamic linker its library may need, next to x86_64's
    assert check_wheel.platform_tag("aarch64") == "manylinux_2_28_aarch64"
    assert check_wheel.platform_tag("x86_64") == "manylinux_2_28_x86_64"
    assert "ld-linux-aarch64.so.1" in check_wheel.glibc_libs("aarch64")
    assert "ld-linux-x86-64.so.2" not in check_wheel.glibc_libs("aarch64")
    report = check_wheel.ElfReport(needed=["libc.so.6", "ld-linux-aarch64.so.1"],
                                   versions={"libc.so.6": {"GLIBC_2.17"}}, exports=["fh_fwd"])
    assert check_wheel.elf_problems(report, "2.28", check_wheel.glibc_libs("aarch64")) == []
    problems = check_wheel.elf_problems(report, "2.28", check_wheel.glibc_libs("x86_64"))
    assert any("ld-linux-aarch64.so.1" in p for p in problems)


def test_glibc_stubs_name_each_architectures_dynamic_linker():
    stubs = _load_tool_at("manylinux/glibc_stubs")
    assert stubs.stubs_of("aarch64")["libld.so.2"][0] == "ld-linux-aarch64.so.1"
    assert stubs.stubs_of("x86_64")["libld.so.2"][0] == "ld-linux-x86-64.so.2"
    with pytest.raises(SystemExit, match="--arch 'riscv64'"):
        stubs.main(["--arch", "riscv64", "--out", "unused"])


def _load_tool_at(relative: str):
    spec = importlib.util.spec_from_file_location(
        "fh_tool_" + relative.replace("/", "_"), TOOLS / f"{relative}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
