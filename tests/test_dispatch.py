"""The backend policy: the library's own (kernels/src/policy.cu), asked with mocked GPUs on CPU, and its plumbing.

Python no longer carries a copy of the policy, so these tests call the real library's
fh_fwd_select_backend over a grid of compute capabilities, dtypes, head dims, layouts and backend
requests, and compare each answer with the rules as documented (dispatch.py's docstring), using
the build's own kernel list. Whatever the build (CI's reduced one, a developer's), every cell is
checked: a request for a kernel the build lacks must fail and name the build variables. The
decode kernel's rung (decode_route) is checked the same way against its table in build_info and
the GPUs' shared memory, and which_backend must name the family that runs (decode included).
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from _helpers import raises
from flash_hopper import (
    UnsupportedError,
    _device,
    _fwd,
    _tables,
    _validate,
    dispatch,
    which_backend,
)
from flash_hopper._lib import FhBackend, FhVariant
from flash_hopper.dispatch import head_dim_bucket
from torch._subclasses.fake_tensor import FakeTensorMode


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


# --- the grid ------------------------------------------------------------------------------------

# Capabilities: pre-Ampere, the 8.x family, Hopper, and later GPUs (which run fa2's PTX, never
# sm90a code). Head dims: bucket edges and a padded one. Layouts: contiguous, and K/V broadcast
# over heads with expand() (stride 0: TMA cannot load it, fa2 can).
CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
DTYPES = ["fp16", "bf16"]
HEAD_DIMS = [64, 72, 128, 192, 256]
LAYOUTS = ["contiguous", "kv_broadcast"]


def params_for(dtype: str, head_dim: int, requested: str, layout: str = "contiguous",
               seqlen_q: int = 64, decode_route: bool = False):
    """The FhFwdParams the host path fills for q (2, seqlen_q, 8, d) and k/v (2, 80, 2 or 8, d),
    decode_route as flash_attn_func's plans set it."""
    with FakeTensorMode():
        torch_dtype = _tables.DTYPE_NAMES[dtype]
        q = torch.empty(2, seqlen_q, 8, head_dim, dtype=torch_dtype, device="cuda")
        if layout == "contiguous":
            k = torch.empty(2, 80, 2, head_dim, dtype=torch_dtype, device="cuda")
        else:
            k = torch.empty(2, 80, 1, head_dim, dtype=torch_dtype, device="cuda").expand(
                2, 80, 8, head_dim)
        cfg = _validate.check_fwd_args(q, k, k, backend=requested)
        effective = _validate.effective_strides
        p = _fwd.fill_params(cfg, effective(q), effective(k), effective(k), effective(q), None,
                             requested)
        p.decode_route = int(decode_route)
        return p


def expected(capability, dtype, head_dim, requested, layout, kernels) -> str | None:
    """The documented rules (dispatch.py): the name that runs, or None when nothing can."""
    backend, variant = _tables.BACKENDS[requested]
    bucket = head_dim_bucket(head_dim)
    fa3_ok = (capability == (9, 0) and ("fa3", dtype, bucket, variant) in kernels
              and layout == "contiguous")
    fa2_ok = capability >= (8, 0) and ("fa2", dtype, bucket, 0) in kernels
    if backend == FhBackend.FA3:
        return requested if fa3_ok else None
    if backend == FhBackend.FA2:
        return "fa2" if fa2_ok else None
    return "fa3" if fa3_ok else "fa2" if fa2_ok else None


@pytest.fixture(scope="module")
def kernels(request):
    from conftest import load_library_or_skip

    info = load_library_or_skip().build_info()
    return {(k["backend"], k["dtype"], k["head_dim"], v)
            for k in _tables.kernel_entries(info) for v in k["variants"]}


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"cc{c[0]}{c[1]}")
def test_the_library_policy_over_the_grid(lib, kernels, capability):
    for dtype, head_dim, requested, layout in itertools.product(
            DTYPES, HEAD_DIMS, _tables.BACKEND_NAMES, LAYOUTS):
        cell = (capability, dtype, head_dim, requested, layout)
        params = params_for(dtype, head_dim, requested, layout)
        want = expected(capability, dtype, head_dim, requested, layout, kernels)
        if want is None:
            with pytest.raises(UnsupportedError) as info:
                dispatch.choose(params, capability)
            message = str(info.value)
            assert f"cc {capability[0]}.{capability[1]}" in message or "FH_" in message \
                or "stride(2) is 0" in message, (cell, message)
        else:
            name, reason, backend = dispatch.choose(params, capability)
            assert (name, backend == FhBackend.FA3) == (want, want.startswith("fa3")), cell
            assert f"cc {capability[0]}.{capability[1]}" in reason, (cell, reason)


def test_the_grid_sees_both_outcomes_in_every_build(lib, kernels):
    # Guard against a vacuous grid: some cells run and some fail, whatever was built.
    outcomes = {expected(c, d, h, r, lay, kernels) is None for c, d, h, r, lay in itertools.product(
        CAPABILITIES, DTYPES, HEAD_DIMS, _tables.BACKEND_NAMES, LAYOUTS)}
    assert outcomes == {True, False}


# --- the messages: they say why and what to change -----------------------------------------------


def _built(kernels, backend, dtype="bf16", bucket=64, variant=0) -> bool:
    return (backend, dtype, bucket, variant) in kernels


def test_reasons_name_the_capability_and_the_kernel(lib, kernels):
    if not _built(kernels, "fa2"):
        pytest.skip("needs the fa2 bf16 hdim 64 kernel (every CI build has it)")
    params = params_for("bf16", 64, "auto")
    assert dispatch.choose(params, (8, 0))[:2] == ("fa2", "cc 8.0: fa3 needs cc 9.0 (sm90a) -> fa2")
    assert dispatch.choose(params, (10, 0))[1] == "cc 10.0: fa3 needs cc 9.0 (sm90a) -> fa2"
    if _built(kernels, "fa3"):
        assert dispatch.choose(params, (9, 0))[:2] == (
            "fa3", "cc 9.0 and fa3 kernel built for bf16 hdim 64 -> fa3")
        bcast = dispatch.choose(params_for("bf16", 64, "auto", "kv_broadcast"), (9, 0))
        assert bcast[0] == "fa2"
        assert bcast[1].startswith("cc 9.0 but k: stride(2) is 0 on a dimension of size 8 "
                                   "(k_head_stride: the fa3 path loads q/k/v with TMA")
    else:
        assert dispatch.choose(params, (9, 0))[:2] == (
            "fa2", "cc 9.0 but this build has no fa3 kernel for bf16 hdim 64 -> fa2")
    assert dispatch.choose(params_for("bf16", 56, "fa2"), (8, 6))[1] == (
        "fa2 requested; cc 8.6 and fa2 kernel built for bf16 hdim 56 (bucket 64)")


def test_errors_name_the_gpu(lib):
    with raises(UnsupportedError, "compute capability >= 8.0", "this GPU is cc 7.5"):
        dispatch.choose(params_for("bf16", 64, "auto"), (7, 5))
    with raises(UnsupportedError, "backend='fa2' needs a GPU of compute capability >= 8.0",
                "cc 7.5"):
        dispatch.choose(params_for("bf16", 64, "fa2"), (7, 5))
    for requested in ("fa3", "fa3-no-pingpong"):
        for capability in ((8, 0), (8, 6), (10, 0)):
            cc = f"{capability[0]}.{capability[1]}"
            with raises(UnsupportedError, f"backend='{requested}' needs a GPU of compute "
                        "capability 9.0", f"this GPU is cc {cc}", "use backend='fa2' or 'auto'"):
                dispatch.choose(params_for("bf16", 64, requested), capability)


def test_missing_kernels_name_the_build_variables(lib, kernels):
    missing = [(d, h) for d in DTYPES for h in (64, 96, 128, 192, 256)
               if not _built(kernels, "fa2", d, h) and not _built(kernels, "fa3", d, h)]
    if not missing:
        pytest.skip("this build has every kernel")
    dtype, bucket = missing[0]
    with raises(UnsupportedError, f"cc 9.0: this build has no fa3 or fa2 kernel for {dtype} hdim "
                f"{bucket}", "FH_ARCHS including 90a", f"FH_HEAD_DIMS including {bucket}",
                f"FH_DTYPES including {dtype}"):
        dispatch.choose(params_for(dtype, bucket, "auto"), (9, 0))
    with raises(UnsupportedError, f"cc 8.0: this build has no fa2 kernel for {dtype} hdim {bucket}",
                "FH_ARCHS including 80"):
        dispatch.choose(params_for(dtype, bucket, "auto"), (8, 0))
    with raises(UnsupportedError, f"backend='fa2': this build has no fa2 kernel for {dtype}",
                "FH_ARCHS including 80"):
        dispatch.choose(params_for(dtype, bucket, "fa2"), (8, 0))
    with raises(UnsupportedError, f"backend='fa3': this build has no fa3 kernel for {dtype}",
                "FH_ARCHS including 90a", "or use backend='auto'"):
        dispatch.choose(params_for(dtype, bucket, "fa3"), (9, 0))
    with raises(UnsupportedError, f"hdim {bucket - 8} (bucket {bucket})"):
        dispatch.choose(params_for(dtype, bucket - 8, "auto"), (9, 0))


def test_an_ablation_kernel_names_its_own_build_variables(lib, kernels):
    cells = [(d, h) for d in DTYPES for h in _tables.HEAD_DIM_BUCKETS
             if _built(kernels, "fa3", d, h) and not _built(kernels, "fa3", d, h, 2)]
    if not cells:
        pytest.skip("needs an fa3 kernel without its no-overlap ablation (CI's build)")
    dtype, bucket = cells[0]
    for requested in ("fa3-no-overlap", "fa3-no-pingpong-no-overlap"):
        with raises(UnsupportedError, f"backend='{requested}': this build has no {requested} "
                    f"kernel for {dtype} hdim {bucket}",
                    f"FH_FA3_ABLATION_DTYPES including {dtype}",
                    f"FH_FA3_ABLATION_HEAD_DIMS including {bucket}"):
            dispatch.choose(params_for(dtype, bucket, requested), (9, 0))
    # Ping-pong is a runtime switch: the tuned kernel serves it.
    name, reason, _ = dispatch.choose(params_for(dtype, bucket, "fa3-no-pingpong"), (9, 0))
    assert name == "fa3-no-pingpong"
    assert reason.startswith("fa3-no-pingpong requested; cc 9.0")


def test_a_broadcast_layout_names_the_tensor_and_the_field(lib, kernels):
    if not _built(kernels, "fa3"):
        pytest.skip("needs the fa3 bf16 hdim 64 kernel (CI's build)")
    with raises(UnsupportedError, "backend='fa3': k: stride(2) is 0 on a dimension of size 8",
                "k_head_stride: the fa3 path loads q/k/v with TMA", "call k.contiguous()",
                "or use backend='fa2' or 'auto'"):
        dispatch.choose(params_for("bf16", 64, "fa3", "kv_broadcast"), (9, 0))
    # fa2 reads through pointers: the layout does not matter there.
    if _built(kernels, "fa2"):
        assert dispatch.choose(params_for("bf16", 64, "fa2", "kv_broadcast"), (9, 0))[0] == "fa2"


def test_hypothetical_needs_no_gpu(lib, kernels, monkeypatch):
    # 128 rows of head dim 64: the decode kernel's, unless FLASH_HOPPER_DECODE closes the route
    name, reason = dispatch.hypothetical((9, 0), "bf16", 64)
    assert name == "decode" and reason.startswith("the decode kernel (cc 9.0): 1 query heads")
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "kvcache")
    want = expected((9, 0), "bf16", 64, "auto", "contiguous", kernels)
    if want is None:
        with raises(UnsupportedError, "FH_"):
            dispatch.hypothetical((9, 0), "bf16", 64)
    else:
        assert dispatch.hypothetical((9, 0), "bf16", 64)[0] == want
    with raises(ValueError, "backend: expected one of auto, fa2, fa3", "'fa4'"):
        dispatch.hypothetical((9, 0), "bf16", 64, "fa4")
    with raises(ValueError, "dtype: expected one of fp16, bf16, e4m3", "'fp8'"):
        dispatch.hypothetical((9, 0), "fp8", 64)


# --- FP8 (e4m3): the FA-3 path's tuned forward, its buckets, cc 9.0 ---------------------------------


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"cc{c[0]}{c[1]}")
def test_the_fp8_policy(lib, kernels, capability):
    for head_dim, requested in itertools.product((64, 80, 128, 160, 256),
                                                  _tables.BACKEND_NAMES):
        cell = (capability, head_dim, requested)
        bucket = head_dim_bucket(head_dim)
        runs = (capability == (9, 0) and requested in ("auto", "fa3")
                and ("fa3", "e4m3", bucket, 0) in kernels)
        if runs:
            name, reason = dispatch.hypothetical(capability, "e4m3", head_dim, requested)
            assert name == "fa3" and "e4m3" in reason, (cell, reason)
            continue
        with pytest.raises(UnsupportedError) as info:
            dispatch.hypothetical(capability, "e4m3", head_dim, requested)
        message = str(info.value)
        if requested not in ("auto", "fa3"):
            assert "e4m3 inputs run on the FA-3 path's tuned kernel only" in message, cell
        elif capability != (9, 0):
            assert "compute capability 9.0" in message and "cc " in message, cell
        else:  # every bucket has an e4m3 kernel (tables.cmake): this build lacks it
            assert "FH_DTYPES including e4m3" in message, cell


# --- plumbing: the device's facts reach the library's policy --------------------------------------


@pytest.fixture
def h100(monkeypatch):
    """A cc 9.0 device for the host path (the library stays real); a fresh plan cache."""
    info = types.SimpleNamespace(capability=(9, 0), sm_count=132)
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    _fwd.clear_plans()
    yield info
    _fwd.clear_plans()


def test_which_backend_asks_the_library_with_the_device_capability(lib, kernels, h100,
                                                                   monkeypatch):
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "kvcache")  # the FA paths' answers
    with FakeTensorMode():
        q = torch.empty(2, 17, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 33, 2, 64, dtype=torch.bfloat16, device="cuda")
        shared = torch.empty(2, 33, 1, 64, dtype=torch.bfloat16, device="cuda").expand(
            2, 33, 8, 64)
    for requested in ("auto", "fa2", "fa3"):
        want = expected((9, 0), "bf16", 64, requested, "contiguous", kernels)
        if want is None:
            with pytest.raises(UnsupportedError):
                which_backend(q, k, k, backend=requested)
        else:
            name, reason = which_backend(q, k, k, backend=requested)
            assert name == want and "cc 9.0" in reason
    h100.capability = (8, 0)
    _fwd.clear_plans()
    if _built(kernels, "fa2"):
        assert which_backend(q, k, k)[0] == "fa2"
        assert which_backend(q, shared, shared) == (
            "fa2", "cc 8.0: fa3 needs cc 9.0 (sm90a) -> fa2")
    with raises(ValueError, "backend", "'fa1'"):
        which_backend(q, k, k, backend="fa1")


def test_which_backend_of_fp8_inputs(lib, kernels, h100):
    with FakeTensorMode():
        q = torch.empty(2, 17, 8, 64, dtype=torch.float8_e4m3fn, device="cuda")
        k = torch.empty(2, 33, 2, 64, dtype=torch.float8_e4m3fn, device="cuda")
    _fwd.clear_plans()
    if ("fa3", "e4m3", 64, 0) in kernels:
        name, reason = which_backend(q, k, k)
        assert name == "fa3" and "e4m3 inputs" in reason
    else:
        with raises(UnsupportedError, "FH_DTYPES including e4m3"):
            which_backend(q, k, k)
    with raises(UnsupportedError, "e4m3 inputs run on the FA-3 path's tuned kernel only"):
        which_backend(q, k, k, backend="fa2")
    h100.capability = (8, 0)
    _fwd.clear_plans()
    with raises(UnsupportedError, "compute capability 9.0", "cc 8.0"):
        which_backend(q, k, k)


def test_which_backend_of_an_empty_problem(h100):
    with FakeTensorMode():
        q = torch.empty(0, 17, 8, 64, dtype=torch.bfloat16, device="cuda")
    assert which_backend(q, q, q) == ("none", "nothing to compute: batch or seqlen_q is 0")


def test_variants_keep_their_name_through_the_policy(lib, kernels, h100):
    params = params_for("bf16", 64, "fa3-no-pingpong")
    assert params.backend == FhBackend.FA3 and params.variant == FhVariant.NO_PINGPONG
    if _built(kernels, "fa3", variant=1):
        assert dispatch.choose(params, (9, 0))[0] == "fa3-no-pingpong"


# --- the decode kernel's rung: the family that runs ------------------------------------------------

# The opt-in shared memory per block (KiB) of the capabilities of the grid, CUDA's tables: the
# decode kernel serves a GPU only where its fewest stages fit (d256 needs more than 99 KiB).
OPTIN_KIB = {(7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 9): 99, (9, 0): 227, (10, 0): 227,
             (12, 0): 99}


def decode_expected(lib, capability, dtype, head_dim, rows, requested, route) -> bool:
    """The decode rung as documented (dispatch.py): asked for (decode_route, backend "auto"), its
    table's dtypes and head dims (build_info "decode"), 1..max_rows packed rows, cc >= 8.0 with
    shared memory for its stages."""
    table = lib.build_info()["decode"]
    return (route and requested == "auto" and capability >= (8, 0)
            and dtype in table["dtypes"] and head_dim in table["head_dims"]
            and 0 < rows <= table["max_rows"]
            and lib.decode_stages(head_dim, OPTIN_KIB[capability] * 1024) > 0)


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"cc{c[0]}{c[1]}")
def test_the_decode_rung_over_the_grid(lib, kernels, capability):
    # Rows: q's 8 heads over 2 KV heads (4 per KV head) x 1 / 32 / 33 tokens: 4, 128 (the bound),
    # 132. Head dims: the decode table's, a bucket it lacks (96) and a padded one (72).
    for dtype, head_dim, seqlen_q, requested, route in itertools.product(
            ("fp16", "bf16"), (64, 72, 96, 128, 256), (1, 32, 33), ("auto", "fa2", "fa3"),
            (False, True)):
        cell = (capability, dtype, head_dim, seqlen_q, requested, route)
        p = params_for(dtype, head_dim, requested, seqlen_q=seqlen_q, decode_route=route)
        if decode_expected(lib, capability, dtype, head_dim, 4 * seqlen_q, requested, route):
            name, reason, backend = dispatch.choose(p, capability)
            assert (name, backend) == ("decode", FhBackend.DECODE), cell
            assert reason.startswith(f"the decode kernel (cc {capability[0]}.{capability[1]}): "
                                     f"4 query heads per KV head x {seqlen_q} tokens"), cell
            continue
        try:
            name = dispatch.choose(p, capability)[0]
        except UnsupportedError:
            continue  # no FA kernel for it: test_the_library_policy_over_the_grid's business
        assert name != "decode", cell
    # FP8 inputs and the mixed mode (128 rows, decode_route as flash_attn_func asks): never it
    for dtype in ("e4m3", "bf16+e4m3", "fp16+e5m2"):
        try:
            assert dispatch.hypothetical(capability, dtype, 128)[0] != "decode", dtype
        except UnsupportedError:
            pass


def test_the_decode_rung_serves_without_fa_kernels(lib, kernels):
    """The decode kernel is in every build: a head dim this build has no FA kernel for still
    runs its short queries there."""
    table = lib.build_info()["decode"]
    missing = [d for d in table["head_dims"]
               if not any(_built(kernels, b, "bf16", d) for b in ("fa2", "fa3"))]
    if not missing:
        pytest.skip("this build has FA kernels for every decode head dim")
    p = params_for("bf16", missing[0], "auto", seqlen_q=1, decode_route=True)
    assert dispatch.choose(p, (9, 0))[0] == "decode"
    p.decode_route = 0
    with raises(UnsupportedError, f"FH_HEAD_DIMS including {missing[0]}"):
        dispatch.choose(p, (9, 0))


def test_the_decode_rung_names_no_route_the_caller_did_not_open(lib):
    # decode_route must be 0 or 1; a varlen request without its bound stays on the FA paths.
    p = params_for("bf16", 64, "auto", seqlen_q=1, decode_route=True)
    p.decode_route = 2
    with raises(ValueError, "decode_route: expected 0 (the FA paths) or 1", "got 2"):
        dispatch.choose(p, (9, 0))


def test_which_backend_names_the_decode_kernel_for_short_queries(lib, kernels, h100,
                                                                 monkeypatch):
    with FakeTensorMode():
        q = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 4096, 8, 128, dtype=torch.bfloat16, device="cuda")
        long_q = torch.empty(2, 40, 32, 128, dtype=torch.bfloat16, device="cuda")
    monkeypatch.delenv("FLASH_HOPPER_DECODE", raising=False)
    name, reason = which_backend(q, k, k)
    assert name == "decode" and reason.startswith(
        "the decode kernel (cc 9.0): 4 query heads per KV head x 1 tokens"), reason
    assert which_backend(q, k, k, causal=True)[0] == "decode"  # masks are in the kernel
    # 160 rows, an explicit FA backend, or the route closed: the FA paths' answer
    for call, env in (((long_q, k, k), "1"), ((q, k, k), "kvcache"), ((q, k, k), "0")):
        monkeypatch.setenv("FLASH_HOPPER_DECODE", env)
        try:
            assert which_backend(*call)[0] != "decode"
        except UnsupportedError as exc:
            assert "FH_HEAD_DIMS including 128" in str(exc)  # no FA kernel in this build
    monkeypatch.delenv("FLASH_HOPPER_DECODE")
    try:
        assert which_backend(q, k, k, backend="fa2")[0] == "fa2"
    except UnsupportedError as exc:
        assert "FH_HEAD_DIMS including 128" in str(exc)
    h100.capability = (8, 6)  # 99 KiB: d128 fits with 2 stages
    _fwd.clear_plans()
    assert which_backend(q, k, k)[0] == "decode"
    h100.capability = (7, 5)
    _fwd.clear_plans()
    with raises(UnsupportedError, "this GPU is cc 7.5"):
        which_backend(q, k, k)


# --- a V head dim of its own (kernels/src/policy.cu, select_own_head_dim_v) ---------------------


def dv_params(dtype: str, head_dim: int, head_dim_v: int, requested: str = "auto"):
    """params_for's request with v's head dim set apart from q / k's."""
    p = params_for(dtype, head_dim, requested)
    p.head_dim_v = head_dim_v
    return p


def test_own_head_dim_v_runs_its_kernel_or_names_what_is_missing(lib):
    info = lib.build_info()
    built = {(k["dtype"], k["head_dim"], k["head_dim_v"])
             for k in info.get("head_dim_v_kernels", [])}
    assert all(d == 192 and dv == 128 for _, d, dv in built), built
    for d, dv in ((192, 128), (136, 104), (160, 120)):
        for requested in ("auto", "fa3", "fa3-no-pingpong"):
            params = dv_params("bf16", d, dv, requested)
            if ("bf16", 192, 128) in built:
                name, reason, backend = dispatch.choose(params, (9, 0))
                assert backend == FhBackend.FA3 and name == requested.replace("auto", "fa3")
                assert f"head_dim {d} / head_dim_v {dv}" in reason and "cc 9.0" in reason
            else:
                with raises(UnsupportedError, "FH_HEAD_DIMS including 192"):
                    dispatch.choose(params, (9, 0))
    # every refusal names the field and what would serve
    cases = [
        (dv_params("bf16", 192, 96), (9, 0), ("head_dim_v: expected 192 (== head_dim) or a "
         "(head_dim, head_dim_v) pair with a kernel of its own: head_dim 136..192 with "
         "head_dim_v 104..128; got (192, 96)")),
        (dv_params("bf16", 128, 120), (9, 0), "got (128, 120)"),
        (dv_params("bf16", 192, 128, "fa2"), (9, 0), "backend='fa2': a V head dim of its own"),
        (dv_params("bf16", 192, 128), (8, 0), ("needs a GPU of compute capability 9.0 (the FA-3 "
         "path), this GPU is cc 8.0")),
    ]
    for params, capability, message in cases:
        with raises(UnsupportedError, message):
            dispatch.choose(params, capability)
    with raises(ValueError, "head_dim_v: expected a multiple of 8"):
        dispatch.choose(dv_params("bf16", 192, 100), (9, 0))


def test_own_head_dim_v_never_takes_the_decode_route(lib):
    params = dv_params("bf16", 192, 128)
    params.decode_route = 1
    params.seqlen_q = 1
    try:
        name = dispatch.choose(params, (9, 0))[0]
    except UnsupportedError as exc:
        assert "FH_HEAD_DIMS including 192" in str(exc)
    else:
        assert name == "fa3"
