"""The forward's host path, one pass down: validate once -> choose the path -> fill the
parameters -> launch.

Every forward entry point runs through here: flash_attn_func in plain eager mode (``eager``), the
``flash_hopper::fwd`` custom op's implementation (``op``: what torch.compile graphs and autograd
call), ``fwd_into`` with caller buffers (``into``) and which_backend (``plan_eager``, no launch).
The varlen entry point (_varlen.py) reuses steps 2-4 on the packed tensors' dense view; the KV
cache's is meant to as well.

1. validate: ``_validate.check_fwd_args`` / ``check_op_args`` (tensor metadata and scalars).
2. choose the path: the library's own policy for the device's compute capability
   (``dispatch.choose``; Python does not re-implement it). flash_attn_func's calls with backend
   "auto" ask with decode_route (FLASH_HOPPER_DECODE allowing it, ``_decode.everywhere``): the
   policy answers "decode" for the short queries the decode kernel serves, and step 4 runs them
   there (``_decode.dense_forward``).
3. fill: an FhFwdParams with everything but the five data pointers, its backend pinned to the
   choice so that fh_fwd runs exactly what the plan names; kept as bytes (``Plan``).
4. launch: copy the bytes into a fresh struct, write the data pointers, call fh_fwd on torch's
   current stream of the tensors' device. The C side validates again (for its other callers,
   in well under a microsecond) and nothing is launched on any error.

Steps 1-3 read metadata only, so ``eager`` and ``op`` keep their result per call signature: the
shapes, strides, dtypes and devices of q/k/v and the other arguments with their types (so True
never passes where 1 was validated). A repeated call then costs a dict lookup, the alignment check
of the data pointers, the output allocation and the launch (bench/host_path.py measures it). Only
successful plans are kept, so a bad call fails the same way every time. Inference servers call
attention once per layer per step with one shape per step: the cache hits for every layer but the
first even while the sequence grows; it is bounded, oldest plans dropped first.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _abi, _decode, _device, _lib, _plan_cache, _validate, dispatch
from ._abi import FhFwdParams
from ._tables import BACKENDS, INPUT_DTYPES, KV_FP8_DTYPES, TORCH_DTYPES

_MAX_PLANS = 256


class Plan(NamedTuple):
    """Steps 1-3 for one call signature; immutable, shared between threads."""

    cfg: _validate.FwdConfig
    # what runs: "fa2", "fa3", an FA-3 variant name, "decode" (the decode kernel) or "none"
    # (nothing to compute)
    backend: str
    reason: str
    template: bytes | None  # FhFwdParams without data pointers; None when nothing is launched
    device: torch.device
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    lib: _lib.Library | None
    out_dtype: torch.dtype  # q's dtype; bf16 / fp16 for FP8 inputs
    # bytes of workspace each launch hands the kernel: the FA-3 path's tile counter for masked
    # calls (fh_fwd_workspace_size), so that their tiles are claimed at run time; else 0
    workspace: int = 0


# Raw accessors where torch has them (what inductor's generated code uses): a Stream object per
# call costs microseconds. CPU-only torch builds lack them; the public API stands in there.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device

_plans = _plan_cache.PlanCache(_MAX_PLANS)


# --- steps 2 and 3 -------------------------------------------------------------------------------


def fill_params(
    cfg: _validate.FwdConfig,
    q_strides: tuple[int, ...],
    k_strides: tuple[int, ...],
    v_strides: tuple[int, ...],
    o_strides: tuple[int, ...],
    lse_strides: tuple[int, ...] | None,
    backend: str,
    num_sms: int = 0,
    fp8: _validate.Fp8Options | None = None,
) -> FhFwdParams:
    """FhFwdParams for a validated request, data pointers null. Strides are effective strides in
    elements (``_validate.effective_strides``); the head_dim stride is 1 and not stored. ``fp8``:
    the FP8 extras (descale strides; their pointers are data, set per call)."""
    p = FhFwdParams()
    p.abi_version = _abi.ABI_VERSION
    p.dtype = p.out_dtype = p.kv_dtype = INPUT_DTYPES[cfg.dtype]
    if fp8 is not None:
        p.out_dtype = TORCH_DTYPES[fp8.out_dtype]
        if fp8.kv_dtype is not None:  # the mixed mode: FP8 k / v
            p.kv_dtype = KV_FP8_DTYPES[fp8.kv_dtype]
        p.fp8_accumulation = (_abi.FhFp8Accumulation.TWO_LEVEL if fp8.two_level
                              else _abi.FhFp8Accumulation.SINGLE_LEVEL)
        for name in ("q", "k", "v"):
            strides = getattr(fp8, f"{name}_descale")
            if strides is not None:
                setattr(p, f"{name}_descale_batch_stride", strides[0])
                setattr(p, f"{name}_descale_head_stride", strides[1])
    p.batch, p.seqlen_q, p.seqlen_k = cfg.batch, cfg.seqlen_q, cfg.seqlen_k
    p.heads_q, p.heads_kv = cfg.heads_q, cfg.heads_kv
    p.head_dim = p.head_dim_v = cfg.head_dim
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = q_strides[:3]
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = k_strides[:3]
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = v_strides[:3]
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = o_strides[:3]
    if lse_strides is not None:
        p.lse_batch_stride, p.lse_head_stride = lse_strides[:2]
    p.softmax_scale = cfg.softmax_scale
    p.softcap = cfg.softcap
    p.window_left, p.window_right = cfg.window_left, cfg.window_right
    p.backend, p.variant = BACKENDS[backend]
    p.num_sms = num_sms
    return p


def make_plan(
    cfg: _validate.FwdConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    with_lse: bool = True,
    num_sms: int = 0,
    fp8: _validate.Fp8Options | None = None,
    decode_route: bool = False,
    head_dim_v: int = 0,
) -> Plan:
    """Choose the path and fill the template for validated tensors (metadata only). ``out`` /
    ``lse``: caller buffers (fwd_into), or None for fresh contiguous ones (``with_lse``: one is
    allocated). ``decode_route``: the caller runs a "decode" answer on the decode kernel.
    ``head_dim_v``: v's head dim where it differs from q / k's (validated by the caller, _dv.py):
    the policy then answers for the kernels with V's own head dim; 0: cfg.head_dim."""
    dv = head_dim_v or cfg.head_dim
    out_shape = (cfg.batch, cfg.seqlen_q, cfg.heads_q, dv)
    lse_shape = (cfg.batch, cfg.heads_q, cfg.seqlen_q)
    out_dtype = fp8.out_dtype if fp8 is not None else cfg.dtype
    if cfg.batch == 0 or cfg.seqlen_q == 0:
        return Plan(cfg, "none", "nothing to compute: batch or seqlen_q is 0", None, q.device,
                    out_shape, lse_shape, None, out_dtype)
    effective, packed = _validate.effective_strides, _validate.packed_strides
    if lse is not None:
        lse_strides = effective(lse)
    else:
        lse_strides = packed(lse_shape) if with_lse else None
    params = fill_params(
        cfg, effective(q), effective(k), effective(v),
        effective(out) if out is not None else packed(out_shape), lse_strides, cfg.backend,
        num_sms, fp8,
    )
    params.head_dim_v = dv
    params.decode_route = int(decode_route)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    name, reason, backend = dispatch.choose(params, _device.device_info(index).capability)
    params.backend = backend  # pinned: fh_fwd runs what the plan names (fwd_into reports it)
    params.decode_route = 0
    lib = _lib.get_library()
    workspace = lib.fwd_workspace_size(params) if backend == _abi.FhBackend.FA3 else 0
    return Plan(cfg, name, reason, bytes(params), q.device, out_shape, lse_shape, lib, out_dtype,
                workspace)


def clear_plans() -> None:
    """Forget every cached plan (tests; a process that rebuilt the library)."""
    _plans.clear()


# --- step 4 --------------------------------------------------------------------------------------


def _launch(plan: Plan, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int,
            descales: tuple[int, int, int] | None = None) -> None:
    """fh_fwd for the plan's template with these data pointers (0: null)."""
    p = FhFwdParams.from_buffer_copy(plan.template)
    p.q, p.k, p.v, p.o, p.lse = q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr
    if descales is not None:
        p.q_descale, p.k_descale, p.v_descale = descales
    if plan.workspace:
        # stream-ordered like the outputs: freed after the launch, reused only behind the kernel
        workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=plan.device)
        p.workspace, p.workspace_bytes = workspace.data_ptr(), plan.workspace
    launch_params(plan, p)


def launch_params(plan: Plan, p: FhFwdParams) -> None:
    """fh_fwd for complete parameters on the plan's device and library (varlen fills its own)."""
    index = plan.device.index
    if _current_device() == index:
        status = plan.lib.fh_fwd(p, _raw_stream(index))
    else:  # the runtime launches on the current device: make it the tensors'
        with torch.cuda.device(index):
            status = plan.lib.fh_fwd(p, _raw_stream(index))
    if status:
        plan.lib.check(status, "fh_fwd")


def _run_new_outputs(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     need_lse: bool = True, descales: tuple[int, int, int] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) in fresh tensors; without need_lse the kernel writes no LSE (lse is None): an
    inference call that returns only out saves an allocation and the LSE stores."""
    if plan.template is not None:
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (q_ptr | k_ptr | v_ptr) & (_validate.ALIGN_BYTES - 1):
            _validate.check_alignment(q=q, k=k, v=v)  # raises, naming the tensor
    out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device)
    if plan.backend == "decode":  # short queries: the policy's answer for a decode_route plan
        return _decode.dense_forward(q, k, v, plan.cfg.softmax_scale,
                                     (plan.cfg.window_left, plan.cfg.window_right),
                                     plan.cfg.softcap, out, need_lse)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device) if need_lse else None
    if plan.template is not None:
        _launch(plan, q_ptr, k_ptr, v_ptr, out.data_ptr(), lse.data_ptr() if need_lse else 0,
                descales)
    return out, lse


# --- entry points --------------------------------------------------------------------------------


# The cache keys: tensor metadata, and each scalar with its type, because 1 == True == 1.0 in a
# dict while validation accepts only some of them. Spelled out (no loops, no *args): they run on
# every call.


def _eager_key(q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, window_size: Any,
               softcap: Any, backend: Any) -> tuple | None:
    if type(window_size) not in (tuple, list) or len(window_size) != 2:
        return None  # validation says what is wrong with it
    left, right = window_size
    try:
        return ("eager", q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
                k.device, v.shape, v.stride(), v.dtype, v.device, type(softmax_scale),
                softmax_scale, type(causal), causal, type(left), left, type(right), right,
                type(softcap), softcap, type(backend), backend)
    except AttributeError:  # not a tensor (which_backend): validation says so
        return None


def _op_key(q: Any, k: Any, v: Any, softmax_scale: Any, window_left: Any, window_right: Any,
            softcap: Any, backend: Any) -> tuple:
    return ("op", q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device, type(softmax_scale), softmax_scale,
            type(window_left), window_left, type(window_right), window_right, type(softcap),
            softcap, type(backend), backend)


def plan_eager(q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, window_size: Any,
               softcap: Any, backend: Any, sm_margin: int = 0) -> Plan:
    """The plan of flash_attn_func's arguments: cached, or validated and made (then cached).
    ``sm_margin``: FA3's, validated by the caller (_device.grid_cap). What the decode route
    depends on (FLASH_HOPPER_DECODE, FLASH_HOPPER_DEBUG_SMEM_LIMIT: _decode.route_key) is part of
    the call signature."""
    key = _eager_key(q, k, v, softmax_scale, causal, window_size, softcap, backend)
    if key is not None:
        key = (key, sm_margin, _decode.route_key())
    plan = _plans.get(key)
    if plan is None:
        cfg = _validate.check_fwd_args(q, k, v, softmax_scale, causal, window_size, softcap,
                                       backend)
        plan = make_plan(cfg, q, k, v, num_sms=_device.grid_cap(q.device, sm_margin),
                         decode_route=_decode.everywhere())
        if key is not None:
            _plans.remember(key, plan)
    return plan


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Any, causal: Any,
          window_size: Any, softcap: Any, backend: Any, need_lse: bool = True,
          sm_margin: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash_attn_func's plain eager path: (out, lse), fresh contiguous tensors (lse None when
    not needed)."""
    plan = plan_eager(q, k, v, softmax_scale, causal, window_size, softcap, backend, sm_margin)
    return _run_new_outputs(plan, q, k, v, need_lse)


def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, window_left: int,
       window_right: int, softcap: float, backend: str, deterministic: bool = False,
       sm_margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op's implementation (window resolved, scale explicit): (out, lse).

    ``deterministic`` does not change the forward (it always is); it is an input of the op so
    that the op's registered backward, which sees only the op's inputs, can pass it on.
    ``sm_margin``: FA3's (SMs the kernel leaves free), the backward's too."""
    key = (_op_key(q, k, v, softmax_scale, window_left, window_right, softcap, backend),
           sm_margin, _decode.route_key())
    plan = _plans.get(key)
    if plan is None:
        cfg = _validate.check_op_args(
            q, k, v, softmax_scale, window_left, window_right, softcap, backend
        )
        plan = make_plan(cfg, q, k, v, num_sms=_device.grid_cap(q.device, sm_margin),
                         decode_route=_decode.everywhere())
        _plans.remember(key, plan)
    return _run_new_outputs(plan, q, k, v)


def into(q: Any, k: Any, v: Any, out: Any, lse: Any, softmax_scale: Any, window_left: Any,
         window_right: Any, softcap: Any, backend: Any, num_sms: int = 0) -> str:
    """fwd_into: validate everything (caller buffers too), plan, launch; the backend that ran."""
    cfg = _validate.check_op_args(
        q, k, v, softmax_scale, window_left, window_right, softcap, backend
    )
    _validate.check_outputs(out, lse, q, cfg)
    _validate.check_alignment(q=q, k=k, v=v, out=out, lse=lse)
    plan = make_plan(cfg, q, k, v, out=out, lse=lse, with_lse=lse is not None, num_sms=num_sms)
    if plan.template is not None:
        _launch(plan, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                lse.data_ptr() if lse is not None else 0)
    return plan.backend


# --- FP8 -----------------------------------------------------------------------------------------


def _descale_key(t: Any) -> tuple | None:
    if t is None:
        return None
    try:
        return (t.shape, t.stride(), t.dtype, t.device)
    except AttributeError:  # not a tensor: validation says so
        return (type(t),)


def fp8_eager(q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, window_size: Any,
              softcap: Any, backend: Any, q_descale: Any, k_descale: Any, v_descale: Any,
              out_dtype: Any, fp8_accumulation: Any,
              need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash_attn_func with torch.float8_e4m3fn q / k / v: (out, lse), out in ``out_dtype``
    (bf16 by default). The same four steps as ``eager``; the descales' metadata is part of the
    call signature and their data pointers are set per call like q / k / v's."""
    plan = plan_fp8(q, k, v, softmax_scale, causal, window_size, softcap, backend, q_descale,
                    k_descale, v_descale, out_dtype, fp8_accumulation)
    return _run_fp8(plan, q, k, v, q_descale, k_descale, v_descale, need_lse)


def plan_fp8(q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, window_size: Any,
             softcap: Any, backend: Any, q_descale: Any = None, k_descale: Any = None,
             v_descale: Any = None, out_dtype: Any = None,
             fp8_accumulation: Any = "two-level") -> Plan:
    """The plan of an FP8 flash_attn_func call: cached, or validated and made (then cached)."""
    key = _eager_key(q, k, v, softmax_scale, causal, window_size, softcap, backend)
    if key is not None:
        key = ("fp8", key, _descale_key(q_descale), _descale_key(k_descale),
               _descale_key(v_descale), type(out_dtype), out_dtype, type(fp8_accumulation),
               fp8_accumulation)
    plan = _plans.get(key)
    if plan is None:
        cfg, fp8 = _validate.check_fp8_args(q, k, v, softmax_scale, causal, window_size, softcap,
                                            backend, q_descale, k_descale, v_descale, out_dtype,
                                            fp8_accumulation)
        plan = make_plan(cfg, q, k, v, fp8=fp8)
        if key is not None:
            _plans.remember(key, plan)
    return plan


def fp8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
           k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, softmax_scale: float,
           window_left: int, window_right: int, softcap: float, backend: str,
           out_dtype: torch.dtype, two_level: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash_hopper::fwd_fp8 custom op's implementation (window resolved, scale explicit):
    (out, lse)."""
    accumulation = "two-level" if two_level else "single-level"
    key = ("fp8-op", _op_key(q, k, v, softmax_scale, window_left, window_right, softcap, backend),
           _descale_key(q_descale), _descale_key(k_descale), _descale_key(v_descale), out_dtype,
           two_level)
    plan = _plans.get(key)
    if plan is None:
        cfg, fp8 = _validate.check_fp8_op_args(
            q, k, v, softmax_scale, window_left, window_right, softcap, backend, q_descale,
            k_descale, v_descale, out_dtype, accumulation)
        plan = make_plan(cfg, q, k, v, fp8=fp8)
        _plans.remember(key, plan)
    return _run_fp8(plan, q, k, v, q_descale, k_descale, v_descale, True)


def descale_pointers(q_descale: Any, k_descale: Any, v_descale: Any) -> tuple[int, int, int]:
    """The descales' data pointers for FhFwdParams (0 for None), each checked to be fp32-aligned
    (check_alignment raises naming the tensor)."""
    descales = tuple(0 if t is None else t.data_ptr() for t in (q_descale, k_descale, v_descale))
    if any(ptr % 4 for ptr in descales):
        _validate.check_alignment(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    return descales


def _run_fp8(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: Any,
             k_descale: Any, v_descale: Any,
             need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    descales = None
    if plan.template is not None:
        descales = descale_pointers(q_descale, k_descale, v_descale)
    return _run_new_outputs(plan, q, k, v, need_lse, descales)
