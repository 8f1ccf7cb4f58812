"""Every validation error, on CPU: each message must name the argument and the offending value.

Shape, dtype and stride checks run before the device check, so CPU tensors exercise them; the
device checks and the full path through flash_attn_func use FakeTensors on a "cuda" device,
which need no GPU (the same metadata-only path torch.compile traces).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from _helpers import raises
from flash_hopper import _device, _fwd, _lib, _validate, flash_attn_func, ops, which_backend
from flash_hopper._validate import check_alignment, check_fwd_args, check_op_args, check_outputs
from torch._subclasses.fake_tensor import FakeTensorMode

BF16 = torch.bfloat16


def make_qkv(b=2, sq=8, sk=8, hq=4, hkv=2, d=64, dtype=BF16, device="cpu", dv=None):
    q = torch.zeros(b, sq, hq, d, dtype=dtype, device=device)
    k = torch.zeros(b, sk, hkv, d, dtype=dtype, device=device)
    v = torch.zeros(b, sk, hkv, d if dv is None else dv, dtype=dtype, device=device)
    return q, k, v


def fake_cuda_qkv(**kwargs):
    with FakeTensorMode():
        return make_qkv(device="cuda", **kwargs)


@pytest.fixture(autouse=True)
def _no_library(monkeypatch):
    """Validation must never need the kernel library or a device query (and no plan cached by
    another test may stand in for it)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("validation touched the library or the device")

    monkeypatch.setattr(_lib, "get_library", forbidden)
    monkeypatch.setattr(_device, "device_info", forbidden)
    _fwd.clear_plans()


# --- q / k / v tensors ---------------------------------------------------------------------------


def test_valid_cpu_tensors_fail_only_on_the_device():
    q, k, v = make_qkv()
    with raises(ValueError, "q: must be a CUDA tensor", "cpu"):
        check_fwd_args(q, k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_a_tensor(which):
    args = dict(zip("qkv", make_qkv()))
    args[which] = [[1.0]]
    with raises(TypeError, f"{which}: expected a torch.Tensor", "list"):
        check_fwd_args(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank(which):
    args = dict(zip("qkv", make_qkv()))
    args[which] = args[which][0]
    with raises(ValueError, f"{which}: expected rank 4", str(tuple(args[which].shape))):
        check_fwd_args(args["q"], args["k"], args["v"])


def test_fp32_is_rejected_with_a_cast_hint():
    with raises(ValueError, "q: expected dtype torch.float16 or torch.bfloat16", "float32",
                ".bfloat16()"):
        check_fwd_args(*make_qkv(dtype=torch.float32))


@pytest.mark.parametrize("which", ["k", "v"])
def test_dtype_mismatch(which):
    args = dict(zip("qkv", make_qkv()))
    args[which] = args[which].half()
    with raises(ValueError, f"{which}: expected dtype torch.bfloat16", "torch.float16"):
        check_fwd_args(args["q"], args["k"], args["v"])


@pytest.mark.parametrize(
    ("which", "dim", "size", "fragment"),
    [
        ("k", 0, 3, "k: expected batch (dim 0) == q's 2, got 3"),
        ("k", 3, 32, "k: expected head_dim (dim 3) == q's 64, got 32"),
        ("v", 0, 1, "v: expected batch (dim 0) == q's 2, got 1"),
        ("v", 1, 9, "v: expected seqlen_k (dim 1) == k's 8, got 9"),
        ("v", 2, 4, "v: expected heads_kv (dim 2) == k's 2, got 4"),
    ],
)
def test_shape_mismatch(which, dim, size, fragment):
    args = dict(zip("qkv", make_qkv()))
    shape = list(args[which].shape)
    shape[dim] = size
    args[which] = torch.zeros(shape, dtype=BF16)
    with raises(ValueError, fragment):
        check_fwd_args(args["q"], args["k"], args["v"])


def test_v_own_head_dim_is_refused_where_the_entry_point_does_not_serve_it():
    with raises(NotImplementedError, "v: head_dim", "128", "served by flash_attn_func"):
        check_fwd_args(*make_qkv(d=64, dv=128))


@pytest.mark.parametrize("d", [0, 4, 12, 60, 264, 512])
def test_head_dim_range_and_multiple(d):
    with raises(ValueError, "head_dim", "multiple of 8 in [8, 256]", f"got {d}"):
        check_fwd_args(*make_qkv(d=d))


def test_heads_must_divide():
    with raises(ValueError, "k: heads_kv (dim 2) must divide q's heads_q 6", "got 4"):
        check_fwd_args(*make_qkv(hq=6, hkv=4))


def test_zero_heads():
    with raises(ValueError, "q: expected heads_q (dim 2) >= 1, got 0"):
        check_fwd_args(*make_qkv(hq=0, hkv=1))
    with raises(ValueError, "k: expected heads_kv (dim 2) >= 1, got 0"):
        check_fwd_args(*make_qkv(hq=2, hkv=0))


def test_batch_and_heads_grid_limits():
    # expand(): 65536-long dims without allocating them.
    q = torch.zeros(1, 1, 1, 8, dtype=BF16).expand(65536, 1, 1, 8)
    with raises(ValueError, "q: expected batch (dim 0) <= 65535", "got 65536"):
        check_fwd_args(q, q, q)
    q = torch.zeros(1, 1, 1, 8, dtype=BF16).expand(1, 1, 65536, 8)
    k = torch.zeros(1, 1, 1, 8, dtype=BF16)
    with raises(ValueError, "q: expected heads_q (dim 2) <= 65535", "got 65536"):
        check_fwd_args(q, k, k)


def test_seqlen_limit():
    long = torch.zeros(1, 1, 1, 8, dtype=BF16).expand(1, 2**31, 1, 8)
    short = torch.zeros(1, 4, 1, 8, dtype=BF16)
    with raises(ValueError, "q: expected seqlen_q (dim 1) <= 2147483647", "got 2147483648"):
        check_fwd_args(long, short, short)
    with raises(ValueError, "k: expected seqlen_k (dim 1) <= 2147483647", "got 2147483648"):
        check_fwd_args(short, long, long)


def test_last_dim_must_be_contiguous():
    q, k, v = make_qkv()
    q = torch.zeros(2, 8, 64, 4, dtype=BF16).transpose(2, 3)  # (2, 8, 4, 64) with stride(-1) 4
    with raises(ValueError, "q: must be contiguous in the last dimension", "q.contiguous()"):
        check_fwd_args(q, k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_strides_must_be_16_byte_multiples(which):
    args = dict(zip("qkv", make_qkv()))
    padded = torch.zeros(*args[which].shape[:3], 68, dtype=BF16)[..., :64]  # head stride 68
    args[which] = padded
    with raises(ValueError, f"{which}: stride(2) must be a multiple of 8 elements", "68"):
        check_fwd_args(args["q"], args["k"], args["v"])


def test_strides_of_size_one_dims_are_ignored():
    # A size-1 seqlen dim with an odd stride is never stepped along: no error, and the kernel gets
    # the packed stride instead.
    q = torch.zeros(2 * 4 * 64 + 5, dtype=BF16).as_strided((2, 1, 4, 64), (4 * 64, 5, 64, 1))
    _, k, v = make_qkv(sq=1)
    with raises(ValueError, "q: must be a CUDA tensor"):
        check_fwd_args(q, k, v)
    assert _validate.effective_strides(q) == (256, 256, 64, 1)


def test_device_mismatch():
    with FakeTensorMode():
        q, _, _ = make_qkv(device="cuda")
        _, k, v = make_qkv(device="cpu")
    with raises(ValueError, "k: must be on q's device cuda:0", "cpu"):
        check_fwd_args(q, k, v)


# --- scalars -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "exc", "fragment"),
    [
        (float("nan"), ValueError, "finite"),
        (math.inf, ValueError, "finite"),
        (0.0, ValueError, "> 0"),
        (-0.125, ValueError, "> 0"),
        (1e39, ValueError, "finite float32"),
        ("0.1", TypeError, "str"),
        (True, TypeError, "bool"),
        (torch.tensor(0.1), TypeError, "torch.Tensor"),
    ],
)
def test_softmax_scale(value, exc, fragment):
    with raises(exc, "softmax_scale", fragment):
        check_fwd_args(*fake_cuda_qkv(), softmax_scale=value)


@pytest.mark.parametrize(
    ("value", "exc", "fragment"),
    [(-1.0, ValueError, ">= 0"), (float("nan"), ValueError, "finite"), (None, TypeError, "None")],
)
def test_softcap(value, exc, fragment):
    with raises(exc, "softcap", fragment):
        check_fwd_args(*fake_cuda_qkv(), softcap=value)


@pytest.mark.parametrize(
    ("window", "exc", "fragment"),
    [
        ((2**63, 0), ValueError, "window_size[0]"),  # would wrap around in int64_t
        ((1.5, 0), TypeError, "window_size[0]"),
        ((0, True), TypeError, "window_size[1]"),
        ((0,), TypeError, "window_size: expected a pair"),
        (4, TypeError, "window_size: expected a pair"),
    ],
)
def test_window_size(window, exc, fragment):
    with raises(exc, fragment):
        check_fwd_args(*fake_cuda_qkv(), window_size=window)


def test_causal_must_be_a_bool():
    with raises(TypeError, "causal: expected a bool", "'yes'"):
        check_fwd_args(*fake_cuda_qkv(), causal="yes")


def test_window_size_as_fa3_reads_it():
    """FA3's semantics: any negative bound is unbounded, causal=True sets the right bound to 0
    whatever window_size says, and FA3's own tests pass the pair as a tensor."""
    def window(**kw):
        cfg = check_fwd_args(*fake_cuda_qkv(), **kw)
        return cfg.window_left, cfg.window_right
    assert window(window_size=(-2, -5)) == (-1, -1)
    assert window(causal=True, window_size=(4, 4)) == (4, 0)
    assert window(causal=True, window_size=(-1, 7)) == (-1, 0)
    assert window(window_size=torch.tensor([3, 9])) == (3, 9)
    assert window(window_size=(torch.tensor(2), torch.tensor(-1, dtype=torch.int32))) == (2, -1)
    assert window(causal=True, window_size=torch.tensor([5, 6])) == (5, 0)
    with raises(TypeError, "window_size[0]", "torch.float32"):
        window(window_size=torch.tensor([1.0, 2.0]))
    with raises(TypeError, "window_size: expected a pair"):
        window(window_size=torch.tensor([[1, 2]]))
    with raises(TypeError, "window_size: expected a pair"):
        window(window_size=torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("backend", ["fa4", "FA3", ""])
def test_backend_name(backend):
    with raises(ValueError, "backend: expected one of auto, fa2, fa3", repr(backend)):
        check_fwd_args(*fake_cuda_qkv(), backend=backend)
    with raises(TypeError, "backend: expected a str", "None"):
        check_fwd_args(*fake_cuda_qkv(), backend=None)


def test_resolved_config():
    cfg = check_fwd_args(*fake_cuda_qkv(sq=5, sk=7, d=96), causal=True, window_size=(16, -1))
    assert (cfg.batch, cfg.seqlen_q, cfg.seqlen_k, cfg.heads_q, cfg.heads_kv) == (2, 5, 7, 4, 2)
    assert cfg.head_dim == 96 and cfg.dtype == BF16
    assert cfg.softmax_scale == pytest.approx(96**-0.5)
    assert (cfg.window_left, cfg.window_right) == (16, 0)  # causal keeps left, sets right to 0
    assert cfg.softcap == 0.0 and cfg.backend == "auto"
    cfg = check_fwd_args(*fake_cuda_qkv(), softmax_scale=2, softcap=3, backend="fa2")
    assert (cfg.softmax_scale, cfg.softcap, cfg.backend) == (2.0, 3.0, "fa2")
    assert isinstance(cfg.softmax_scale, float)


def test_op_level_arguments():
    q, k, v = fake_cuda_qkv()
    with raises(ValueError, "window_left: expected an int >= -1", "-3"):
        check_op_args(q, k, v, 0.1, -3, 0, 0.0, "auto")
    with raises(TypeError, "softmax_scale", "None"):
        check_op_args(q, k, v, None, -1, -1, 0.0, "auto")
    cfg = check_op_args(q, k, v, 0.5, 3, 2, 1.0, "fa3")
    assert (cfg.window_left, cfg.window_right, cfg.softcap, cfg.backend) == (3, 2, 1.0, "fa3")


def test_return_attn_probs_must_be_a_bool():
    with raises(TypeError, "return_attn_probs", "1"):
        flash_attn_func(*fake_cuda_qkv(), return_attn_probs=1)


# --- outputs of fwd_into -------------------------------------------------------------------------


def _cfg_and_qkv():
    q, k, v = make_qkv()
    with FakeTensorMode():
        cfg = check_fwd_args(*make_qkv(device="cuda"))
    return cfg, q, k, v


@pytest.mark.parametrize(
    ("out", "lse", "fragment"),
    [
        (torch.zeros(2, 8, 4, 32, dtype=BF16), None, "out: expected shape (2, 8, 4, 64)"),
        (torch.zeros(2, 8, 4, 64, dtype=torch.half), None, "out: expected dtype torch.bfloat16"),
        (torch.zeros(2, 8, 4, 68, dtype=BF16)[..., :64], None, "out: stride(2) must be a multiple"),
        (
            torch.zeros(2, 8, 4, 64, dtype=BF16),
            torch.zeros(2, 8, 4),
            "lse: expected shape (2, 4, 8)",
        ),
        (
            torch.zeros(2, 8, 4, 64, dtype=BF16),
            torch.zeros(2, 4, 8, dtype=BF16),
            "lse: expected dtype torch.float32",
        ),
        (
            torch.zeros(2, 8, 4, 64, dtype=BF16),
            torch.zeros(2, 8, 4).transpose(1, 2),
            "lse: must be contiguous in the last dimension",
        ),
    ],
)
def test_outputs(out, lse, fragment):
    cfg, q, _, _ = _cfg_and_qkv()
    with raises(ValueError, fragment):
        check_outputs(out, lse, q, cfg)


def test_misaligned_data_pointer():
    base = torch.zeros(2 * 8 * 4 * 64 + 8, dtype=BF16)
    q = base[1 : 1 + 2 * 8 * 4 * 64].view(2, 8, 4, 64)  # 2 bytes past a 16-byte boundary
    assert base.data_ptr() % 16 == 0
    with raises(ValueError, "q: data pointer must be 16-byte aligned", "storage_offset 1",
                ".contiguous()"):
        check_alignment(q=q)
    check_alignment(q=base[8 : 8 + 64].view(1, 1, 1, 64))  # 16 bytes in: fine


def test_fwd_into_validates_before_touching_library_or_device():
    q, k, v = make_qkv()
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 8)
    with raises(ValueError, "q: must be a CUDA tensor"):
        ops.fwd_into(q, k, v, out, lse, 0.1, -1, -1, 0.0, "auto")
    with raises(ValueError, "backend", "'fa9'"):
        ops.fwd_into(*fake_cuda_qkv(), out, lse, 0.1, -1, -1, 0.0, "fa9")


def test_which_backend_validates_before_asking_anything():
    q, k, v = fake_cuda_qkv()
    with raises(TypeError, "q: expected a torch.Tensor", "list"):
        which_backend([[1.0]], k, v)
    with raises(TypeError, "window_size: expected a pair"):
        which_backend(q, k, v, window_size=(1, 2, 3))
    with raises(ValueError, "backend: expected one of auto, fa2, fa3", "'fa9'"):
        which_backend(q, k, v, backend="fa9")


# --- the backward's arguments --------------------------------------------------------------------


def bwd_args(device="cpu", **changes):
    """check_bwd_args' arguments for a valid (2, 8, 4:2, 64) problem, some replaced."""
    q, k, v = make_qkv(device=device)
    args = {
        "dout": torch.zeros_like(q), "q": q, "k": k, "v": v, "out": torch.zeros_like(q),
        "lse": torch.zeros(2, 4, 8, device=device), "dlse": None, "softmax_scale": 0.125,
        "window_left": -1, "window_right": 0, "softcap": 0.0, "backend": "auto",
        "deterministic": False,
    }
    args.update(changes)
    return args


def test_valid_bwd_args_pass_on_fake_cuda_tensors():
    with FakeTensorMode():
        dlse = torch.zeros(2, 4, 8, device="cuda")
        cfg = _validate.check_bwd_args(**bwd_args(device="cuda", dlse=dlse, deterministic=True))
    assert cfg.deterministic is True and cfg.has_dlse
    assert (cfg.fwd.batch, cfg.fwd.seqlen_q, cfg.fwd.heads_q, cfg.fwd.heads_kv) == (2, 8, 4, 2)
    assert (cfg.fwd.window_left, cfg.fwd.window_right, cfg.fwd.softmax_scale) == (-1, 0, 0.125)


def test_valid_cpu_bwd_args_fail_only_on_the_device():
    with raises(ValueError, "q: must be a CUDA tensor", "cpu"):
        _validate.check_bwd_args(**bwd_args())


Q_SHAPE = (2, 8, 4, 64)


@pytest.mark.parametrize(
    ("changes", "exc", "fragments"),
    [
        ({"dout": torch.zeros(2, 8, 4, 32, dtype=BF16)}, ValueError,
         ("dout: expected shape (2, 8, 4, 64) (out's shape), got (2, 8, 4, 32)",)),
        ({"dout": torch.zeros(Q_SHAPE, dtype=torch.half)}, ValueError,
         ("dout: expected dtype torch.bfloat16 (out's dtype), got torch.float16",)),
        ({"dout": torch.zeros(2, 8, 4)}, ValueError, ("dout: expected rank 4", "(2, 8, 4)")),
        ({"dout": [1.0]}, TypeError, ("dout: expected a torch.Tensor", "list")),
        ({"out": torch.zeros(2, 7, 4, 64, dtype=BF16)}, ValueError,
         ("out: expected shape (2, 8, 4, 64) (q's shape), got (2, 7, 4, 64)",)),
        ({"out": torch.zeros(Q_SHAPE, dtype=torch.half)}, ValueError,
         ("out: expected dtype torch.bfloat16 (q's dtype), got torch.float16",)),
        ({"out": torch.zeros(2, 8, 4, 128, dtype=BF16)[..., ::2]}, ValueError,
         ("out: must be contiguous in the last dimension", "out.contiguous()")),
        ({"lse": torch.zeros(2, 8, 4)}, ValueError,
         ("lse: expected shape (2, 4, 8) (batch, heads_q, seqlen_q), got (2, 8, 4)",)),
        ({"lse": torch.zeros(2, 4, 8, dtype=BF16)}, ValueError,
         ("lse: expected dtype torch.float32, got torch.bfloat16",)),
        ({"lse": torch.zeros(2, 8, 4).transpose(1, 2)}, ValueError,
         ("lse: must be contiguous in the last dimension (stride 1)", "(32, 1, 4)")),
        ({"lse": None}, TypeError, ("lse: expected a torch.Tensor, got NoneType",)),
        ({"dlse": torch.zeros(2, 4, 9)}, ValueError,
         ("dlse: expected shape (2, 4, 8)", "got (2, 4, 9)")),
        ({"dlse": torch.zeros(2, 4, 8, dtype=torch.float64)}, ValueError,
         ("dlse: expected dtype torch.float32, got torch.float64",)),
        ({"dlse": torch.zeros(2, 8, 4).transpose(1, 2)}, ValueError,
         ("dlse: must be contiguous in the last dimension (stride 1)",)),
        ({"deterministic": 1}, TypeError, ("deterministic: expected a bool, got int 1",)),
        ({"deterministic": None}, TypeError, ("deterministic: expected a bool", "None")),
        ({"backend": "fa9"}, ValueError, ("backend: expected one of", "'fa9'")),
        ({"window_left": -2}, ValueError, ("window_left", "-2")),
        ({"softcap": -1.0}, ValueError, ("softcap: expected a float >= 0", "-1.0")),
        ({"softmax_scale": None}, TypeError, ("softmax_scale: expected a float, got None",)),
        ({"q": torch.zeros(2, 8, 3, 64, dtype=BF16)}, ValueError,
         ("k: heads_kv (dim 2) must divide q's heads_q 3",)),
    ],
)
def test_bwd_arg_messages(changes, exc, fragments):
    # CPU tensors: every metadata check comes before the device check.
    with raises(exc, *fragments):
        _validate.check_bwd_args(**bwd_args(**changes))


def test_bwd_devices_are_named():
    with FakeTensorMode():
        args = bwd_args(device="cuda")
        for name in ("dout", "out", "lse"):
            bad = dict(args, **{name: args[name].to("cpu")})
            with raises(ValueError, f"{name}: must be on q's device cuda", "got device cpu"):
                _validate.check_bwd_args(**bad)
        bad = dict(args, dlse=torch.zeros(2, 4, 8))
        with raises(ValueError, "dlse: must be on q's device cuda", "got device cpu"):
            _validate.check_bwd_args(**bad)


@pytest.mark.parametrize(
    ("dout", "needs_copy"),
    [
        (torch.zeros(Q_SHAPE, dtype=BF16), False),
        (torch.zeros(2, 4, 8, 64, dtype=BF16).transpose(1, 2), False),  # (b, h, s, d) storage
        (torch.zeros(2, 8, 4, 128, dtype=BF16)[..., ::2], True),  # last stride 2
        (torch.zeros(2, 8, 64, 4, dtype=BF16).transpose(2, 3), True),  # last stride 4
        (torch.zeros(2, 8, 4, 68, dtype=BF16)[..., :64], True),  # rows of 136 bytes
        (torch.zeros(2, 8, 1, 64, dtype=BF16).expand(2, 8, 4, 64), True),  # stride 0 heads
        (torch.zeros(1, 1, 1, 64, dtype=BF16).as_strided((1, 1, 1, 64), (3, 3, 3, 1)), False),
    ],
)
def test_dout_layouts_the_kernels_cannot_load_are_copied(dout, needs_copy):
    assert _validate.dout_needs_copy(dout) is needs_copy


@pytest.mark.parametrize(
    ("which", "bad", "fragment"),
    [
        ("dq", torch.zeros(2, 8, 4, 32, dtype=BF16), "dq: expected shape (2, 8, 4, 64) (q's"),
        ("dk", torch.zeros(2, 8, 2, 64, dtype=torch.half), "dk: expected dtype torch.bfloat16"),
        ("dv", torch.zeros(2, 8, 2, 128, dtype=BF16)[..., ::2], "dv: must be contiguous"),
        ("dv", torch.zeros(2, 8, 4, 64, dtype=BF16), "dv: expected shape (2, 8, 2, 64) (v's"),
    ],
)
def test_caller_gradients(which, bad, fragment):
    q, k, v = make_qkv()
    grads = {"dq": torch.zeros_like(q), "dk": torch.zeros_like(k), "dv": torch.zeros_like(v)}
    grads[which] = bad
    with raises(ValueError, fragment):
        _validate.check_grads(grads["dq"], grads["dk"], grads["dv"], q, k, v)


# --- FA3's flash_attn_func signature -------------------------------------------------------------

# hopper/flash_attn_interface.py's flash_attn_func (FlashAttention @ 0251105a): names, order and
# defaults. FA3's tests and inference servers call it positionally too.
FA3_SIGNATURE = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
    ("v", inspect.Parameter.empty), ("softmax_scale", None), ("causal", False), ("qv", None),
    ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
    ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
    ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False),
]


def test_flash_attn_func_has_fa3s_signature():
    params = list(inspect.signature(flash_attn_func).parameters.values())
    positional = [(p.name, p.default) for p in params
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == FA3_SIGNATURE
    extra = [p for p in params if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.kind, p.default) for p in extra] == [
        ("backend", inspect.Parameter.KEYWORD_ONLY, "auto"),
        ("out_dtype", inspect.Parameter.KEYWORD_ONLY, None),
        ("fp8_accumulation", inspect.Parameter.KEYWORD_ONLY, "two-level"),
        ("sinks", inspect.Parameter.KEYWORD_ONLY, None)]


@pytest.mark.parametrize(("kwargs", "exc", "fragments"), [
    ({"out_dtype": torch.float16}, ValueError, ("out_dtype: expected None or torch.bfloat16",)),
    ({"fp8_accumulation": "single-level"}, ValueError,
     ("fp8_accumulation: expected 'two-level'", "FP8 inputs")),
    ({"attention_chunk": -1}, ValueError, ("attention_chunk: expected an int >= 0", "got -1")),
    ({"attention_chunk": 1.5}, TypeError, ("attention_chunk: expected an int",)),
    ({"num_splits": -1}, TypeError, ("num_splits: expected an int >= 0", "-1")),
    ({"sm_margin": "4"}, TypeError, ("sm_margin: expected an int >= 0",)),
    ({"pack_gqa": 1}, TypeError, ("pack_gqa: expected None or a bool",)),
])
def test_fa3_parameters_this_package_does_not_serve(kwargs, exc, fragments):
    q, k, v = make_qkv()
    with raises(exc, *fragments):
        flash_attn_func(q, k, v, **kwargs)


def test_descales_with_16_bit_inputs_are_ignored_as_in_fa3():
    # FA3 reads descales for float8_e4m3fn q only; vLLM passes them with every call.
    q, k, v = make_qkv()
    one = torch.ones(q.shape[0], k.shape[2])
    with raises(ValueError, "q: must be a CUDA tensor"):  # past validation
        flash_attn_func(q, k, v, q_descale=one, k_descale=one, v_descale=one)


@pytest.mark.parametrize("kwargs", [{"num_splits": 0}, {"num_splits": 4}, {"pack_gqa": True},
                                    {"pack_gqa": False}, {"sm_margin": 8}])
def test_fa3_performance_hints_are_accepted(kwargs):
    # Past the hint checks, the CPU tensors fail on the device as without the hint.
    q, k, v = make_qkv()
    with raises(ValueError, "q: must be a CUDA tensor"):
        flash_attn_func(q, k, v, **kwargs)


def test_fa3_positional_call():
    # flash_attn_func(q, k, v, scale, causal, qv, q_descale, k_descale, v_descale, window_size):
    # a positional window lands in window_size, not in qv.
    q, k, v = make_qkv()
    with raises(ValueError, "q: must be a CUDA tensor"):
        flash_attn_func(q, k, v, None, True, None, None, None, None, (4, 0))
    with raises(TypeError, "qv: expected a torch.Tensor, got tuple"):
        flash_attn_func(q, k, v, None, True, (4, 0))
