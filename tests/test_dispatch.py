"""Backend policy with mocked GPUs and builds (CPU), and its plumbing in ops / which_backend."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from _helpers import raises
from flash_hopper import UnsupportedError, _device, _lib, _validate, dispatch, ops, which_backend
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.dispatch import HEAD_DIM_BUCKETS, head_dim_bucket, select_backend
from torch._subclasses.fake_tensor import FakeTensorMode

ALL = {(b, dt, hd) for b in ("fa2", "fa3") for dt in ("fp16", "bf16") for hd in HEAD_DIM_BUCKETS}
FA2_ONLY = {kernel for kernel in ALL if kernel[0] == "fa2"}


@pytest.mark.parametrize(
    ("head_dim", "bucket"),
    [(8, 64), (64, 64), (72, 96), (96, 96), (104, 128), (128, 128), (136, 192), (192, 192),
     (200, 256), (256, 256)],
)
def test_head_dim_bucket(head_dim, bucket):
    assert head_dim_bucket(head_dim) == bucket


def test_head_dim_bucket_above_256():
    with raises(ValueError, "head_dim", "264"):
        head_dim_bucket(264)


@pytest.mark.parametrize(
    ("capability", "built", "expected", "reason"),
    [
        ((9, 0), ALL, "fa3", "cc 9.0 and fa3 kernel built for bf16 hdim 128 -> fa3"),
        ((9, 0), FA2_ONLY, "fa2", "cc 9.0 but this build has no fa3 kernel for bf16 hdim 128"),
        ((8, 0), ALL, "fa2", "cc 8.0: fa3 needs cc 9.0"),
        ((8, 6), ALL, "fa2", "cc 8.6"),
        ((8, 9), FA2_ONLY, "fa2", "cc 8.9"),
        ((10, 0), ALL, "fa2", "cc 10.0: fa3 needs cc 9.0"),  # sm90a code does not run on 10.x
        ((12, 0), ALL, "fa2", "cc 12.0"),
    ],
)
def test_auto(capability, built, expected, reason):
    backend, why = select_backend("auto", capability, built, "bf16", 128)
    assert backend == expected
    assert reason in why


def test_auto_on_pre_ampere_names_the_capability():
    with raises(UnsupportedError, "compute capability >= 8.0", "this GPU is cc 7.5"):
        select_backend("auto", (7, 5), ALL, "fp16", 64)


def test_auto_without_any_kernel_for_the_request_names_the_build_variables():
    built = {k for k in ALL if k[2] != 96}
    with raises(UnsupportedError, "no fa3 or fa2 kernel for fp16 hdim 72 (bucket 96)",
                "FH_ARCHS including 90a", "FH_HEAD_DIMS including 96", "FH_DTYPES including fp16"):
        select_backend("auto", (9, 0), built, "fp16", 72)
    with raises(UnsupportedError, "no fa2 kernel for fp16 hdim 72 (bucket 96)",
                "FH_ARCHS including 80"):
        select_backend("auto", (8, 0), built, "fp16", 72)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (7, 5), (10, 0)])
def test_forced_fa3_needs_cc_9_0(capability):
    cc = f"{capability[0]}.{capability[1]}"
    with raises(UnsupportedError, "backend='fa3'", "compute capability 9.0", f"cc {cc}"):
        select_backend("fa3", capability, ALL, "bf16", 128)


def test_forced_fa3_needs_the_kernel():
    with raises(UnsupportedError, "backend='fa3'", "no fa3 kernel for bf16 hdim 128",
                "FH_ARCHS including 90a", "FH_HEAD_DIMS including 128", "FH_DTYPES including bf16"):
        select_backend("fa3", (9, 0), FA2_ONLY, "bf16", 128)
    assert select_backend("fa3", (9, 0), ALL, "bf16", 128)[0] == "fa3"


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0)])
def test_forced_fa2_runs_on_every_ampere_or_newer(capability):
    assert select_backend("fa2", capability, ALL, "fp16", 256)[0] == "fa2"


def test_forced_fa2_errors():
    with raises(UnsupportedError, "backend='fa2'", "compute capability >= 8.0", "cc 7.5"):
        select_backend("fa2", (7, 5), ALL, "fp16", 64)
    fp16_only = {k for k in ALL if k[1] == "fp16"}
    with raises(UnsupportedError, "no fa2 kernel for bf16 hdim 64", "FH_DTYPES including bf16"):
        select_backend("fa2", (8, 0), fp16_only, "bf16", 64)


@pytest.mark.parametrize("requested", ["FA2", "fa4", "", "flash"])
def test_unknown_backend_name(requested):
    with raises(ValueError, "backend", repr(requested)):
        select_backend(requested, (9, 0), ALL, "bf16", 128)


def test_built_may_be_a_callable_and_is_asked_for_the_bucket():
    asked = []

    def built(backend, dtype, bucket):
        asked.append((backend, dtype, bucket))
        return backend == "fa2"

    assert select_backend("auto", (9, 0), built, "fp16", 40)[0] == "fa2"
    assert ("fa3", "fp16", 64) in asked and ("fa2", "fp16", 64) in asked


# --- plumbing: the real device/library facts reach the policy -----------------------------------


class FakeLibrary:
    """Stands in for _lib.Library: answers has_fwd_kernel from a set of enum triples."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.calls = []

    def has_fwd_kernel(self, backend, dtype, head_dim):
        self.calls.append((backend, dtype, head_dim))
        return (backend, dtype, head_dim) in self.kernels


LAYOUT = "k: stride(2) is 0 on a dimension of size 8"


def test_fa3_layout_problem_sends_auto_to_fa2_and_fa3_raises():
    backend, why = select_backend("auto", (9, 0), ALL, "bf16", 128, LAYOUT)
    assert backend == "fa2" and why == f"cc 9.0 but {LAYOUT} -> fa2"
    for requested in ("fa3", "fa3-no-pingpong"):
        with raises(UnsupportedError, "backend='fa3'", LAYOUT, "backend='fa2' or 'auto'"):
            select_backend(requested, (9, 0), ALL, "bf16", 128, LAYOUT)
    assert select_backend("fa2", (9, 0), ALL, "bf16", 128, LAYOUT)[0] == "fa2"
    # Only the fa3 kernel is built: nothing can run the layout; say why and what to build.
    fa3_only = ALL - FA2_ONLY
    with raises(UnsupportedError, LAYOUT, "no fa2 kernel for bf16 hdim 128", "FH_ARCHS including 80"):
        select_backend("auto", (9, 0), fa3_only, "bf16", 128, LAYOUT)
    # The layout does not matter where fa3 cannot run anyway.
    assert select_backend("auto", (8, 0), ALL, "bf16", 128, LAYOUT) == (
        "fa2", "cc 8.0: fa3 needs cc 9.0 (sm90a) -> fa2")


def test_tma_layout_problem_names_the_tensor_dim_and_strides():
    q = torch.empty(2, 16, 8, 64)
    k_shared = torch.empty(2, 16, 1, 64).expand(2, 16, 8, 64)  # one K head broadcast to 8
    assert _validate.tma_layout_problem(q=q, k=q, v=q) is None
    assert _validate.tma_layout_problem(q=q, k=torch.empty(2, 16, 1, 64), v=q) is None  # size 1
    problem = _validate.tma_layout_problem(q=q, k=k_shared, v=k_shared)
    assert problem.startswith("k: stride(2) is 0 on a dimension of size 8")
    assert str(tuple(k_shared.stride())) in problem and "k.contiguous()" in problem
    batch_bcast = torch.empty(1, 16, 8, 64).expand(3, 16, 8, 64)
    assert _validate.tma_layout_problem(q=q, k=q, v=batch_bcast).startswith(
        "v: stride(0) is 0 on a dimension of size 3")


def test_which_backend_passes_the_layout_to_dispatch(fake_h100, monkeypatch):
    seen = {}

    def select(*args):
        seen["problem"] = args[-1]
        raise UnsupportedError("stop here")

    monkeypatch.setattr(dispatch, "select_backend", select)
    with FakeTensorMode():
        q = torch.empty(1, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 16, 1, 128, dtype=torch.bfloat16, device="cuda").expand(1, 16, 8, 128)
        with raises(UnsupportedError, "stop here"):
            which_backend(q, k, k)
    assert seen["problem"].startswith("k: stride(2) is 0")


@pytest.fixture
def fake_h100(monkeypatch):
    lib = FakeLibrary({(FhBackend.FA3, FhDtype.BF16, 128), (FhBackend.FA2, FhDtype.BF16, 128)})
    info = types.SimpleNamespace(capability=(9, 0), sm_count=132)
    monkeypatch.setattr(_lib, "get_library", lambda: lib)
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    return lib


def test_resolve_backend_passes_enums_and_buckets(fake_h100):
    backend, _ = ops.resolve_backend(torch.device("cuda", 0), torch.bfloat16, 112, "auto")
    assert backend == "fa3"
    assert (FhBackend.FA3, FhDtype.BF16, 128) in fake_h100.calls
    with raises(UnsupportedError, "fa3", "fp16"):
        ops.resolve_backend(torch.device("cuda", 0), torch.float16, 128, "fa3")


def test_which_backend(fake_h100):
    with FakeTensorMode():
        q = torch.empty(2, 17, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 33, 2, 128, dtype=torch.bfloat16, device="cuda")
    assert which_backend(q, k, k) == ("fa3", "cc 9.0 and fa3 kernel built for bf16 hdim 128 -> fa3")
    assert which_backend(q, k, k, backend="fa2")[0] == "fa2"
    with raises(ValueError, "backend"):
        which_backend(q, k, k, backend="fa1")


def test_dispatch_module_is_pure():
    # The policy must stay importable and testable without torch, ctypes or a device.
    source = Path(dispatch.__file__).read_text()
    assert "import torch" not in source and "ctypes" not in source
