"""Peer backends: PyTorch SDPA (one per kernel), FlexAttention, and installed FA packages.

Layouts: every backend takes and returns (batch, seqlen, heads, head_dim), packed (total, heads,
head_dim) for varlen. SDPA and flex want (batch, heads, seqlen, head_dim); they get transposed
*views*, which is also what their flash kernels use internally, so no copy is timed.

Masks come from flash_hopper.mask (the mirror of the kernels' policy). FA's causal is bottom-right
aligned when seqlen_q != seqlen_k, SDPA's is_causal is top-left. SDPA's flash and cuDNN kernels take
no mask, so bottom-right causal and windows are skipped there with a reason; the efficient and math
kernels get an explicit boolean mask (the kernel name says so, since reading the mask costs
bandwidth). Flex gets the policy's elementwise visible() as its mask_mod.

FP8 (e4m3): SDPA and flex take no float8_e4m3fn inputs, so they are skipped for e4m3 cases
("unsupported (no FP8)", fp8_reason). An FA package runs them only when its flash_attn_func
declares q_descale, k_descale and v_descale (FA3's hopper interface does); it then gets the FP8
data and the descales as flash-hopper's fa3 does.

Mixed mode (bf16+e4m3, ...: 16-bit q against FP8 K / V): no peer runs it. SDPA, flex and the FA
packages (FA2, FA3's hopper interface, the CuTe DSL FA4) all require q, k and v of one dtype, so
each is skipped for mixed cases with its reason ("unsupported (no mixed mode)", mixed_reason);
a peer without its own answer gets base.Backend's.

Varlen (packed (total, heads, d) q, k, v of self-attention sequences): SDPA runs it on jagged
nested tensors (``pack_jagged``: torch.nested.nested_tensor_from_jagged on the case's offsets,
built before timing, transposed to (batch, heads, j, d)), is_causal per sequence (top-left and
bottom-right agree when q and k have the same lengths), and the output goes back to the packed
layout (``unpack_jagged``, a view). torch's jagged SDPA takes no mask and no enable_gqa, so
windows and GQA are skipped with a reason, and its math kernel refuses is_causal. An FA package
runs it when it has flash_attn_varlen_func taking cu_seqlens_q / cu_seqlens_k (FA2, FA3, FA4).
Flex is not wired up for varlen (it would need a document mask over the packed batch).

FlashInfer (``flashinfer``: the flashinfer-python wheel; its kernels are compiled on first use,
so the first call of a shape takes the JIT's time outside the timed ones): prefill through its
ragged-KV batch wrapper, dense cases as a batch of equal sequences (q, k, v viewed packed, no
copy) and varlen cases on their own offsets, planned before timing. Its causal mask is
bottom-right aligned as FA's; its window bounds the left side only, so a window with a right
bound other than 0 is skipped with a reason. No FP8 or mixed-mode path here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator, Sequence
from typing import Callable

from flash_hopper.mask import AttentionMask

from .base import Backend
from .errors import first_line

SDPA_KINDS = ("flash", "cudnn", "efficient", "math")
_SDPA_ENUM = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
              "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
# sdpa-math materializes b*h*sq*sk scores (plus softmax and grads): 2^28 elements is ~1 GB per
# bf16 copy; beyond that it is slow enough to dominate a sweep and says nothing new.
MATH_MAX_SCORE_ELEMENTS = 1 << 28
# FA3's FP8 arguments: a package's flash_attn_func must declare all three to get e4m3 cases.
FP8_DESCALES = ("q_descale", "k_descale", "v_descale")
# A package's flash_attn_varlen_func must take the offsets by these names to get varlen cases.
VARLEN_OFFSETS = ("cu_seqlens_q", "cu_seqlens_k")


def needs_mask(case) -> bool:
    return not case.attention_mask().is_full


def _to_bhsd(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)


def pack_jagged(packed, offsets):
    """A packed (total, heads, d) tensor as a jagged nested tensor (batch, heads, j, d) for SDPA:
    a view of ``packed``; ``offsets`` (int64, on its device) are the sequences' cu_seqlens."""
    import torch

    return torch.nested.nested_tensor_from_jagged(packed, offsets).transpose(1, 2)


def unpack_jagged(nested):
    """pack_jagged's inverse for an SDPA output: (batch, heads, j, d) back to the packed
    (total, heads, d) values."""
    return nested.transpose(1, 2).values()


class SdpaBackend(Backend):
    origin = "torch"

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"sdpa-{kind}"
        self.label = f"SDPA {kind}"
        self.min_capability = (8, 0) if kind in ("flash", "cudnn") else (5, 0)

    def _enum(self):
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, _SDPA_ENUM[self.kind])

    def software_reason(self) -> str | None:
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as exc:
            return f"needs torch.nn.attention.sdpa_kernel (torch >= 2.3): {first_line(exc)}"
        if not hasattr(SDPBackend, _SDPA_ENUM[self.kind]):
            return f"torch {torch.__version__} has no SDPBackend.{_SDPA_ENUM[self.kind]}"
        return None

    def runtime_reason(self) -> str | None:
        import torch

        # is_flash_attention_available exists from torch 2.5; before it, a CUDA build has the kernel.
        flash_available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
        if self.kind == "flash" and flash_available is not None and not flash_available():
            return f"this torch build ({torch.__version__}) has no flash SDPA kernel"
        if self.kind == "cudnn" and not torch.backends.cudnn.is_available():
            return "cuDNN is not available to this torch build"
        return None

    def version(self) -> str | None:
        import torch

        if self.kind == "cudnn" and torch.backends.cudnn.is_available():
            return f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"
        return f"torch {torch.__version__}"

    def fp8_reason(self) -> str | None:
        return "torch SDPA takes fp16 / bf16 / fp32 inputs, not float8_e4m3fn"

    def mixed_reason(self) -> str | None:
        return ("torch SDPA takes q, k and v of one fp16 / bf16 / fp32 dtype, not FP8 k / v with "
                "descales")

    def varlen_reason(self) -> str | None:
        return None  # jagged nested tensors (module docstring)

    def unsupported(self, case, direction: str | None = None) -> str | None:
        if case.softcap:
            return "SDPA has no softcap"
        if case.is_varlen:
            varlen_reason = self._varlen_unsupported(case)
            if varlen_reason:
                return varlen_reason
        elif self.kind in ("flash", "cudnn") and needs_mask(case):
            if case.has_window:
                return (f"SDPA {self.kind} takes no mask, so no sliding window "
                        "(sdpa-efficient / sdpa-math run it with an explicit mask)")
            if case.seqlen_q != case.seqlen_k:
                return (f"SDPA {self.kind}'s is_causal is top-left aligned for seqlen_q != "
                        "seqlen_k; FA's bottom-right causal needs an explicit mask")
        if self.kind == "efficient" and case.heads != case.heads_kv:
            return "SDPA's efficient kernel has no GQA (enable_gqa runs on flash and math only)"
        if self.kind == "math" and case.score_elements() > MATH_MAX_SCORE_ELEMENTS:
            return (f"sdpa-math materializes {case.score_elements():,} scores (h*sq*sk per "
                    f"sequence); small sizes only (limit {MATH_MAX_SCORE_ELEMENTS:,})")
        return None

    def _varlen_unsupported(self, case) -> str | None:
        if case.has_window:
            return "SDPA on jagged nested tensors takes no mask, so no sliding window"
        if case.heads != case.heads_kv:
            return "SDPA on jagged nested tensors has no GQA (no enable_gqa)"
        if self.kind == "math" and case.causal:
            return "SDPA math on jagged nested tensors refuses is_causal"
        return None

    @staticmethod
    def explicit_mask(case) -> bool:
        """Everything but plain causal with seqlen_q == seqlen_k (is_causal) needs a mask."""
        mask = case.attention_mask()
        return not mask.is_full and not (mask.is_plain_causal and case.seqlen_q == case.seqlen_k)

    def make_forward(self, q, k, v, case):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        if case.is_varlen:
            return self._varlen_forward(q, k, v, case)
        qt, kt, vt = _to_bhsd(q, k, v)
        mask = None
        if self.explicit_mask(case):
            mask = case.attention_mask().dense(device=q.device)
        # No explicit mask but a mask needed: plain causal on a square, which is_causal means
        # (also when spelled as window (-1, 0) without causal=True).
        kwargs = {"attn_mask": mask, "is_causal": mask is None and needs_mask(case)}
        if case.heads != case.heads_kv:
            kwargs["enable_gqa"] = True  # only passed when needed: older torch lacks the keyword
        enum = self._enum()

        def run():
            with sdpa_kernel([enum]):
                return F.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)

        return run

    def _varlen_forward(self, q, k, v, case):
        """SDPA on jagged views of the packed inputs; the output as packed (total, heads, d)."""
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        offsets = torch.tensor(case.cu_seqlens(), dtype=torch.int64, device=q.device)
        qj, kj, vj = (pack_jagged(t, offsets) for t in (q, k, v))
        enum = self._enum()

        def run():
            with sdpa_kernel([enum]):
                return unpack_jagged(F.scaled_dot_product_attention(qj, kj, vj,
                                                                    is_causal=case.causal))

        return run

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        if case.is_varlen:
            return self.name, (f"forced with sdpa_kernel(SDPBackend.{_SDPA_ENUM[self.kind]}), "
                               f"jagged nested tensors ({case.batch} sequences)")
        if self.explicit_mask(case):
            return self.name, "explicit boolean mask (bottom-right causal / window)"
        return self.name, f"forced with sdpa_kernel(SDPBackend.{_SDPA_ENUM[self.kind]})"


_COMPILED_FLEX = None


def _compiled_flex():
    """One torch.compile'd flex_attention per process: compiling is the slow part."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_mask_mod(mask: AttentionMask):
    """FlexAttention's mask_mod for ``mask``: index tensors in, a bool tensor out."""
    def mask_mod(b, h, q_idx, kv_idx):
        return mask.visible(q_idx, kv_idx)

    return mask_mod


def make_softcap_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        import torch

        return softcap * torch.tanh(score / softcap)

    return score_mod


class FlexBackend(Backend):
    name = "flex"
    label = "FlexAttention"
    origin = "torch"

    def software_reason(self) -> str | None:
        try:
            from torch.nn.attention.flex_attention import (  # noqa: F401
                create_block_mask,
                flex_attention,
            )
        except ImportError as exc:
            return f"needs torch.nn.attention.flex_attention (torch >= 2.5): {first_line(exc)}"
        if importlib.util.find_spec("triton") is None:
            return "FlexAttention compiles through triton, which is not installed"
        return None

    def version(self) -> str | None:
        import torch

        return f"torch {torch.__version__}"

    def fp8_reason(self) -> str | None:
        return "FlexAttention takes no float8_e4m3fn inputs with descales"

    def mixed_reason(self) -> str | None:
        return "FlexAttention takes q, k and v of one dtype, not FP8 k / v with descales"

    def varlen_reason(self) -> str | None:
        return ("not wired up: FlexAttention would need a document mask over the packed batch "
                "(a block mask per drawn batch)")

    def make_forward(self, q, k, v, case):
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _compiled_flex()
        qt, kt, vt = _to_bhsd(q, k, v)
        kwargs = {}
        if needs_mask(case):
            mask_mod = flex_mask_mod(case.attention_mask())
            kwargs["block_mask"] = create_block_mask(mask_mod, None, None, case.seqlen_q,
                                                     case.seqlen_k, device=q.device)
        if case.softcap:
            kwargs["score_mod"] = make_softcap_mod(case.softcap)
        if case.heads != case.heads_kv:
            kwargs["enable_gqa"] = True
        return lambda: flex(qt, kt, vt, **kwargs).transpose(1, 2)

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        return "flex", "torch.compile(flex_attention), triton kernel"


@contextlib.contextmanager
def argv_shielded() -> Iterator[None]:
    """sys.argv holds only the program name while a peer is imported: some packages parse it on
    import (the CuTe DSL behind flash_attn.cute does, and argparse's prefix matching read our
    `-d 128` as its `-diagnostic`, ending the run)."""
    saved = sys.argv
    sys.argv = saved[:1] or [""]
    try:
        yield
    finally:
        sys.argv = saved


class FlashAttnPackage(Backend):
    """An installed FlashAttention package exposing flash_attn_func in FA's layout."""

    origin = "external"

    def __init__(self, name: str, label: str, modules: Sequence[str],
                 distributions: Sequence[str], min_capability=(8, 0),
                 only_major: int | None = None):
        self.name = name
        self.label = label
        self.modules = tuple(modules)
        self.distributions = tuple(distributions)
        self.min_capability = min_capability
        self.only_major = only_major
        self._func: Callable | None = None
        self._varlen_func: Callable | None = None
        self._module_name = ""

    @property
    def module_name(self) -> str:
        """The module software_reason imported ("" before it has, or when none imports)."""
        return self._module_name

    def software_reason(self) -> str | None:
        failures = []
        for module_name in self.modules:
            try:
                with argv_shielded():
                    module = importlib.import_module(module_name)
            except Exception as exc:  # noqa: BLE001 - ImportError, OSError (torch-ABI mismatch)...
                failures.append(f"{module_name}: {first_line(exc)}")
                continue
            except SystemExit as exc:  # a package that exits on import must not end the sweep
                failures.append(f"{module_name}: exited on import (SystemExit {exc.code!r})")
                continue
            func = getattr(module, "flash_attn_func", None)
            if func is None:
                failures.append(f"{module_name}: has no flash_attn_func")
                continue
            self._func, self._module_name = func, module_name
            self._varlen_func = getattr(module, "flash_attn_varlen_func", None)
            return None
        return "not importable (" + "; ".join(failures) + ")"

    def version(self) -> str | None:
        from importlib import metadata

        for dist in self.distributions:
            try:
                return f"{dist} {metadata.version(dist)}"
            except metadata.PackageNotFoundError:
                continue
        return None

    def _accepts(self, keyword: str, varlen: bool = False) -> bool:
        """Does flash_attn_func (flash_attn_varlen_func with ``varlen``) take ``keyword``?"""
        try:
            func = self._varlen_func if varlen else self._func
            return keyword in inspect.signature(func).parameters
        except (TypeError, ValueError):  # builtins without a signature: let the call decide
            return True

    def fp8_reason(self) -> str | None:
        """FP8 only where flash_attn_func declares the descales (FA3's does): strictly from the
        signature, since an FP8 tensor passed to an fp16/bf16-only kernel is not a clean skip."""
        if self._func is None and self.software_reason():
            return "not importable"
        try:
            parameters = inspect.signature(self._func).parameters
        except (TypeError, ValueError):
            return f"{self._module_name}.flash_attn_func has no inspectable signature"
        missing = [n for n in FP8_DESCALES if n not in parameters]
        if missing:
            return f"{self._module_name}.flash_attn_func takes no {' / '.join(missing)}"
        return None

    def mixed_reason(self) -> str | None:
        """FA packages check that q, k and v share one dtype (FA3's FP8 forward takes FP8 q
        too), whatever their signature: no mixed-mode path."""
        if self._func is None and self.software_reason():
            return "not importable"
        return (f"{self._module_name}.flash_attn_func takes q, k and v of one dtype, not 16-bit "
                f"q with FP8 k / v")

    def varlen_reason(self) -> str | None:
        if self._func is None and self.software_reason():
            return "not importable"
        if self._varlen_func is None:
            return f"{self._module_name} has no flash_attn_varlen_func (no varlen entry point)"
        missing = [n for n in VARLEN_OFFSETS if not self._accepts(n, varlen=True)]
        if missing:
            return (f"{self._module_name}.flash_attn_varlen_func takes no "
                    f"{' / '.join(missing)}")
        return None

    def unsupported(self, case, direction: str | None = None) -> str | None:
        if self._func is None and self.software_reason():
            return "not importable"
        name = "flash_attn_varlen_func" if case.is_varlen else "flash_attn_func"
        if case.softcap and not self._accepts("softcap", case.is_varlen):
            return f"{self._module_name}.{name} has no softcap argument"
        if case.has_window and not self._accepts("window_size", case.is_varlen):
            return f"{self._module_name}.{name} has no window_size argument"
        return None

    def _call(self, q, k, v, case) -> Callable[[], object]:
        func = self._func
        kwargs = {"causal": case.causal}
        if case.is_varlen:
            import torch

            func = self._varlen_func
            cu = torch.tensor(case.cu_seqlens(), dtype=torch.int32, device=q.device)
            kwargs.update(dict.fromkeys(VARLEN_OFFSETS, cu))
            for keyword in ("max_seqlen_q", "max_seqlen_k"):
                if self._accepts(keyword, varlen=True):
                    kwargs[keyword] = case.seqlen_q
        if case.has_window:
            kwargs["window_size"] = tuple(case.window)
        if case.softcap:
            kwargs["softcap"] = case.softcap
        if case.is_fp8:  # Fp8Inputs: FA3's FP8 convention is flash-hopper's
            kwargs.update(zip(FP8_DESCALES, (q.descale, k.descale, v.descale)))
            q, k, v = q.data, k.data, v.data
        return lambda: func(q, k, v, **kwargs)

    def make_forward(self, q, k, v, case):
        call = self._call(q, k, v, case)

        def run():
            out = call()
            # FA3's beta interface returns (out, lse); FA2 returns out.
            return out[0] if isinstance(out, (tuple, list)) else out

        return run

    def run_checked(self, q, k, v, case):
        result = self._call(q, k, v, case)()
        if not isinstance(result, (tuple, list)):
            return result, None
        # (out, lse) from FA3's interface: check the LSE too when it has our (b, h, sq) layout,
        # (h, total) for varlen.
        lse = result[1] if len(result) > 1 else None
        shape = q.data.shape if case.is_fp8 else q.shape
        lse_shape = (shape[1], shape[0]) if case.is_varlen else (shape[0], shape[2], shape[1])
        return result[0], lse if getattr(lse, "shape", None) == lse_shape else None

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        if case.is_varlen:
            return self.name, f"{self._module_name}.flash_attn_varlen_func"
        descales = " with q/k/v descales (FP8)" if case.is_fp8 else ""
        return self.name, f"{self._module_name}.flash_attn_func{descales}"


def import_flashinfer(wrapper: str):
    """(the flashinfer module, None), or (None, why not): it does not import, or it has no
    ``wrapper`` class (the 0.2 API's plan / run wrappers). The one import of FlashInfer, shared by
    the prefill peer here and the decode sweep's."""
    try:
        with argv_shielded():
            module = importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - ImportError, a torch-ABI mismatch...
        return None, f"not importable (flashinfer: {first_line(exc)})"
    except SystemExit as exc:
        return None, f"not importable (flashinfer: exited on import, SystemExit {exc.code!r})"
    if not hasattr(module, wrapper):
        return None, f"flashinfer has no {wrapper} (a pre-0.2 release?)"
    return module, None


class FlashInferBackend(Backend):
    """FlashInfer's prefill (flashinfer.BatchPrefillWithRaggedKVCacheWrapper) as a peer."""

    name = "flashinfer"
    label = "FlashInfer"
    origin = "external"
    # its planner's workspace (FlashInfer's examples take 128 MB)
    workspace_bytes = 128 * 2**20

    def __init__(self):
        self._module = None

    def software_reason(self) -> str | None:
        module, reason = import_flashinfer("BatchPrefillWithRaggedKVCacheWrapper")
        self._module = module
        return reason

    def version(self) -> str | None:
        from importlib import metadata

        for dist in ("flashinfer-python", "flashinfer"):
            try:
                return f"{dist} {metadata.version(dist)}"
            except metadata.PackageNotFoundError:
                continue
        return None

    def varlen_reason(self) -> str | None:
        if self._module is None and self.software_reason():
            return "not importable"
        return None

    def unsupported(self, case, direction: str | None = None) -> str | None:
        if self._module is None and self.software_reason():
            return "not importable"
        if direction is not None and "bwd" in direction:  # "bwd", "fwd+bwd"
            return "FlashInfer has no backward"
        if case.has_window and case.window[1] != 0:
            return (f"FlashInfer's window bounds the left side only (window_left); window "
                    f"{tuple(case.window)} has a right bound")
        return None

    def _planned(self, q, k, case):
        """The wrapper with its plan: offsets, heads and mask planned once, before timing."""
        import torch

        if case.is_varlen:
            qo = kv = torch.tensor(case.cu_seqlens(), dtype=torch.int32, device=q.device)
            heads_q, head_dim = q.shape[1], q.shape[2]
            heads_kv = k.shape[1]
        else:
            batch, seqlen_q, heads_q, head_dim = q.shape
            seqlen_k, heads_kv = k.shape[1], k.shape[2]
            qo = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32,
                              device=q.device)
            kv = torch.arange(0, (batch + 1) * seqlen_k, seqlen_k, dtype=torch.int32,
                              device=q.device)
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=q.device)
        wrapper = self._module.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD")
        # a window with right bound 0 is causal with a left bound (unsupported() took the rest)
        causal = case.causal or case.has_window
        kwargs = {"causal": causal, "q_data_type": q.dtype, "kv_data_type": k.dtype}
        if case.has_window:
            kwargs["window_left"] = case.window[0]
        if case.softcap:
            kwargs["logits_soft_cap"] = case.softcap
        wrapper.plan(qo, kv, heads_q, heads_kv, head_dim, **kwargs)
        return wrapper

    def make_forward(self, q, k, v, case):
        wrapper = self._planned(q, k, case)
        if case.is_varlen:
            return lambda: wrapper.run(q, k, v)
        shape = q.shape
        packed = [t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v)]
        return lambda: wrapper.run(*packed).view(shape)

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        return self.name, "flashinfer.BatchPrefillWithRaggedKVCacheWrapper (NHD, JIT-compiled)"


def external_backends() -> list[Backend]:
    return [
        FlashAttnPackage("flash-attn", "flash-attn (FA2)", ["flash_attn"], ["flash-attn",
                                                                             "flash_attn"]),
        # FA3's hopper/ interface: from a source build (flash_attn_interface), the flash_attn_3
        # wheels, or the forward-only fa3-fwd wheel (fa3_fwd_interface: BF16 + e4m3, built
        # against torch's stable ABI, so it loads with any recent torch).
        FlashAttnPackage("flash-attn3", "flash-attn3 (FA3)",
                         ["flash_attn_interface", "flash_attn_3.flash_attn_interface",
                          "flash_attn_3", "fa3_fwd_interface"],
                         ["flash_attn_3", "flash-attn-3", "flashattn-hopper", "fa3-fwd"],
                         only_major=9),
        FlashAttnPackage("flash-attn-cute", "flash-attn CuTe DSL", ["flash_attn.cute"],
                         ["flash-attn-cute", "flash-attn"], min_capability=(9, 0)),
        FlashInferBackend(),
    ]
