"""The backward's host path, the forward's four steps (_fwd.py) with a workspace.

Entry points: the ``flash_hopper::bwd`` custom op's implementation (``op``: what the registered
autograd of ``flash_hopper::fwd`` and torch.compile graphs call, and what the eager
``torch.autograd.Function`` of flash_attn_func calls directly) and ``bwd_into`` with caller
buffers (``into``, tests and benchmarks).

1. validate: ``_validate.check_bwd_args`` (tensor metadata and scalars; traceable).
2. choose the path: the library's backward policy for the device's compute capability
   (``dispatch.choose_bwd``, fh_bwd_select_backend), pinned in the plan.
3. fill: an FhBwdParams with everything but the data pointers and the workspace, and the
   workspace's size for it (fh_bwd_workspace_size: host arithmetic); kept as bytes (``Plan``).
4. launch: alignment check; fresh dq/dk/dv (contiguous, q/k/v's shapes) and a uint8 workspace
   from torch's caching allocator on the tensors' device (so the backward is graph-capturable and
   its memory is torch's); the pointers written into a copy of the template; fh_bwd on torch's
   current stream. The library launches its three kernels there without a host synchronization.

``dout`` comes from whatever the loss did: a layout the kernels cannot load (a non-unit last
stride, strides that are not 16-byte multiples, a broadcast; ``_validate.dout_needs_copy``) is
made contiguous first, as FA3 does; that decision is metadata, so it is part of the plan. A dout
whose data pointer alone is misaligned is copied too (a per-call fact: the copy's strides are
written into the struct for that call).

Plans are cached per call signature like the forward's: the metadata of every tensor argument
(dlse's presence included) and each scalar with its type.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _abi, _device, _lib, _plan_cache, _validate, dispatch
from ._abi import FhBwdParams
from ._fwd import _current_device, _raw_stream
from ._tables import BACKENDS, TORCH_DTYPES

_MAX_PLANS = 256


class Plan(NamedTuple):
    """Steps 1-3 for one call signature; immutable, shared between threads."""

    cfg: _validate.BwdConfig
    backend: str  # what runs: "fa2", "fa3", or "none" (batch == 0: nothing to compute)
    reason: str
    template: bytes | None  # FhBwdParams without data pointers; None when nothing is launched
    workspace_bytes: int
    copy_dout: bool  # dout's layout is not loadable: pass dout.contiguous()
    device: torch.device
    lib: _lib.Library | None


_plans = _plan_cache.PlanCache(_MAX_PLANS)


# --- steps 2 and 3 -------------------------------------------------------------------------------


def fill_params(
    cfg: _validate.BwdConfig,
    strides: dict[str, tuple[int, ...]],
    backend: str,
    num_sms: int = 0,
) -> FhBwdParams:
    """FhBwdParams for a validated request, data pointers and workspace null. ``strides``: the
    effective strides in elements of q, k, v, o, dout, dq, dk, dv, lse and (when present) dlse;
    the head_dim stride is 1 and not stored."""
    fwd = cfg.fwd
    p = FhBwdParams()
    p.abi_version = _abi.ABI_VERSION
    p.dtype = TORCH_DTYPES[fwd.dtype]
    p.deterministic = int(cfg.deterministic)
    p.batch, p.seqlen_q, p.seqlen_k = fwd.batch, fwd.seqlen_q, fwd.seqlen_k
    p.heads_q, p.heads_kv = fwd.heads_q, fwd.heads_kv
    p.head_dim = p.head_dim_v = fwd.head_dim
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = strides["q"][:3]
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = strides["k"][:3]
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = strides["v"][:3]
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = strides["o"][:3]
    p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride = strides["dout"][:3]
    p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride = strides["dq"][:3]
    p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride = strides["dk"][:3]
    p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride = strides["dv"][:3]
    p.lse_batch_stride, p.lse_head_stride = strides["lse"][:2]
    if "dlse" in strides:
        p.dlse_batch_stride, p.dlse_head_stride = strides["dlse"][:2]
    p.softmax_scale = fwd.softmax_scale
    p.softcap = fwd.softcap
    p.window_left, p.window_right = fwd.window_left, fwd.window_right
    # The FA-3 ablation variants have no backward of their own: they train with the tuned one.
    p.backend, p.variant = BACKENDS[backend][0], 0
    p.num_sms = num_sms
    return p


def make_plan(
    cfg: _validate.BwdConfig,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_sms: int = 0,
) -> Plan:
    """Choose the path, fill the template and size the workspace for validated tensors
    (metadata only). ``grads``: caller buffers (bwd_into), or None for fresh contiguous ones."""
    copy_dout = _validate.dout_needs_copy(dout)
    if cfg.fwd.batch == 0:
        return Plan(cfg, "none", "nothing to compute: batch is 0", None, 0, copy_dout, q.device,
                    None)
    effective, packed = _validate.effective_strides, _validate.packed_strides
    strides = {
        "q": effective(q), "k": effective(k), "v": effective(v), "o": effective(out),
        "dout": packed(tuple(dout.shape)) if copy_dout else effective(dout),
        "lse": effective(lse),
    }
    if grads is None:
        strides.update(dq=packed(tuple(q.shape)), dk=packed(tuple(k.shape)),
                       dv=packed(tuple(v.shape)))
    else:
        strides.update(dq=effective(grads[0]), dk=effective(grads[1]), dv=effective(grads[2]))
    if dlse is not None:
        strides["dlse"] = effective(dlse)
    params = fill_params(cfg, strides, cfg.fwd.backend, num_sms)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    name, reason, backend = dispatch.choose_bwd(params, _device.device_info(index).capability)
    params.backend = backend  # pinned: fh_bwd runs what the plan names (bwd_into reports it)
    lib = _lib.get_library()
    params.workspace_bytes = lib.bwd_workspace_size(params)
    return Plan(cfg, name, reason, bytes(params), params.workspace_bytes, copy_dout, q.device,
                lib)


def clear_plans() -> None:
    """Forget every cached plan (tests; a process that rebuilt the library)."""
    _plans.clear()


# --- step 4 --------------------------------------------------------------------------------------


def _loadable_dout(plan: Plan, dout: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(dout as the kernels load it, whether its strides differ from the plan's): the plan's
    copy for layouts the kernels cannot load, a per-call copy for a misaligned data pointer."""
    if plan.copy_dout:
        return dout.contiguous(), False
    if dout.numel() and dout.data_ptr() & (_validate.ALIGN_BYTES - 1):
        # clone, not contiguous(): a contiguous dout would come back as itself, misaligned.
        copy = dout.clone(memory_format=torch.contiguous_format)
        return copy, _validate.effective_strides(copy) != _validate.effective_strides(dout)
    return dout, False


def _launch(plan: Plan, dout: torch.Tensor, restride_dout: bool, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
            workspace: torch.Tensor) -> None:
    """fh_bwd for the plan's template with these tensors' data pointers."""
    p = FhBwdParams.from_buffer_copy(plan.template)
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p.lse, p.dout = lse.data_ptr(), dout.data_ptr()
    p.dlse = dlse.data_ptr() if dlse is not None else 0
    p.dq, p.dk, p.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    p.workspace = workspace.data_ptr()
    if restride_dout:
        p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride = (
            _validate.effective_strides(dout)[:3])
    launch_params(plan, p)


def launch_params(plan: Plan, p: FhBwdParams) -> None:
    """fh_bwd for a complete FhBwdParams on the plan's device and torch's current stream."""
    index = plan.device.index
    if _current_device() == index:
        status = plan.lib.fh_bwd(p, _raw_stream(index))
    else:  # the runtime launches on the current device: make it the tensors'
        with torch.cuda.device(index):
            status = plan.lib.fh_bwd(p, _raw_stream(index))
    if status:
        plan.lib.check(status, "fh_bwd")


def _check_pointers(q, k, v, out, lse, dlse) -> None:
    """Raise, naming the tensor, for a misaligned data pointer (one test on the usual path)."""
    if ((q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & (_validate.ALIGN_BYTES - 1)
            or lse.data_ptr() & 3 or (dlse is not None and dlse.data_ptr() & 3)):
        _validate.check_alignment(q=q, k=k, v=v, out=out, lse=lse, dlse=dlse)


def _workspace(plan: Plan) -> torch.Tensor:
    return torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=plan.device)


def _run_new_grads(plan: Plan, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in fresh contiguous tensors."""
    if plan.template is not None:
        _check_pointers(q, k, v, out, lse, dlse)
        dout, restride = _loadable_dout(plan, dout)
    dq = torch.empty(q.shape, dtype=q.dtype, device=plan.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=plan.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=plan.device)
    if plan.template is not None:
        _launch(plan, dout, restride, q, k, v, out, lse, dlse, dq, dk, dv, _workspace(plan))
    return dq, dk, dv


# --- entry points --------------------------------------------------------------------------------


def _meta(t: Any) -> tuple:
    if t is None:
        return (None,)
    return (t.shape, t.stride(), t.dtype, t.device)


def _op_key(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dlse: Any,
            softmax_scale: Any, window_left: Any, window_right: Any, softcap: Any, backend: Any,
            deterministic: Any) -> tuple | None:
    # Each scalar with its type: 1 == True == 1.0 in a dict while validation accepts only some.
    try:
        return ("op", *_meta(dout), *_meta(q), *_meta(k), *_meta(v), *_meta(out), *_meta(lse),
                *_meta(dlse), type(softmax_scale), softmax_scale, type(window_left), window_left,
                type(window_right), window_right, type(softcap), softcap, type(backend), backend,
                type(deterministic), deterministic)
    except AttributeError:  # not a tensor: validation says so
        return None


def op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
       lse: torch.Tensor, dlse: torch.Tensor | None, softmax_scale: float, window_left: int,
       window_right: int, softcap: float, backend: str, deterministic: bool,
       sm_margin: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bwd custom op's implementation: (dq, dk, dv), fresh contiguous tensors. ``sm_margin``:
    FA3's, SMs the kernel leaves free."""
    key = _op_key(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right,
                  softcap, backend, deterministic)
    if key is not None and sm_margin:
        key = (key, sm_margin)
    plan = _plans.get(key)
    if plan is None:
        cfg = _validate.check_bwd_args(dout, q, k, v, out, lse, dlse, softmax_scale, window_left,
                                       window_right, softcap, backend, deterministic)
        plan = make_plan(cfg, dout, q, k, v, out, lse, dlse,
                         num_sms=_device.grid_cap(q.device, sm_margin))
        if key is not None:
            _plans.remember(key, plan)
    return _run_new_grads(plan, dout, q, k, v, out, lse, dlse)


def into(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any,
         softmax_scale: Any, window_left: Any, window_right: Any, softcap: Any, backend: Any,
         deterministic: Any, dlse: Any, num_sms: int = 0, cache: bool = False) -> str:
    """bwd_into: validate everything (caller buffers too), plan, launch; the backend that ran.
    ``cache``: keep the plan per call signature (the gradient buffers' metadata and num_sms
    included), as ``op`` does: flash_attn_qkvpacked_func's backward, called every step."""
    key = None
    if cache:
        key = _op_key(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right,
                      softcap, backend, deterministic)
        try:
            key = None if key is None else ("into", key, *_meta(dq), *_meta(dk), *_meta(dv),
                                            num_sms)
        except AttributeError:  # a gradient buffer that is not a tensor: validation says so
            key = None
    plan = _plans.get(key)
    if plan is None:
        cfg = _validate.check_bwd_args(dout, q, k, v, out, lse, dlse, softmax_scale,
                                       window_left, window_right, softcap, backend,
                                       deterministic)
        _validate.check_grads(dq, dk, dv, q, k, v)
        plan = make_plan(cfg, dout, q, k, v, out, lse, dlse, grads=(dq, dk, dv),
                         num_sms=num_sms)
        if key is not None:
            _plans.remember(key, plan)
    _validate.check_alignment(q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, dq=dq, dk=dk, dv=dv)
    if plan.template is not None:
        dout, restride = _loadable_dout(plan, dout)
        _launch(plan, dout, restride, q, k, v, out, lse, dlse, dq, dk, dv, _workspace(plan))
    return plan.backend
