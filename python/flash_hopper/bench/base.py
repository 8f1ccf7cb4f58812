"""The interface every benchmark backend implements: a leaf module (it imports nothing of the
package), so flash-hopper's own backends (backends.py), the peers (peers.py) and the registry that
lists them all (registry.py) can each import it without importing one another.

A backend answers, in this order: can it run in this process at all (`probe`: importable, built,
right GPU), can it run this configuration (`unsupported`), and then builds a zero-argument callable
for one configuration (`make_forward`) and names the kernel that actually runs (`kernel`). Every
"no" comes with a reason that the CLI prints and the result files record: nothing is skipped
silently. `run_checked` is the one call the reference check compares (see check.py), and
`run_checked_backward` the one its gradient check compares; `bwd_workspace_bytes` is the backward's
scratch memory by the backend's own formula, where it has one.

FP8 (e4m3) cases come first through `fp8_reason`: a backend without an FP8 path is skipped for
them with "unsupported (no FP8): <reason>" before anything else is asked; one with a path gets
q, k, v as fp8_inputs.Fp8Input (data and descale) in every call below. Mixed-mode cases
("bf16+e4m3", ...) likewise come first through `mixed_reason` ("unsupported (no mixed mode):
<reason>"); a backend with that path gets q as a 16-bit tensor and k, v as Fp8Inputs.
Varlen cases (Case.seqlens) likewise come first through `varlen_reason` ("unsupported (no
varlen): <reason>"); a backend with a varlen path gets q, k, v packed (total tokens, heads,
head_dim), builds its offsets from case.cu_seqlens() outside the timed callable, and returns the
output in the same packed layout (its LSE, where it has one, as (heads, total tokens)).
`timing_context` wraps a backend's timed calls (warm-up included), for settings that belong to
timing only.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

# (major, minor) compute capability of the GPU, or None without one.
Capability = Optional[tuple[int, int]]


class Backend:
    name = ""
    label = ""  # plot legend
    origin = ""  # flash-hopper | torch | external
    min_capability: tuple[int, int] = (8, 0)
    # Set when the backend only runs on one architecture family (FA3-style sm90 kernels).
    only_major: int | None = None
    # Set when the backend only takes cases of these dtypes (an FP8 ablation: ("e4m3",)); `all`
    # leaves it out of sweeps without them.
    only_dtypes: tuple[str, ...] | None = None

    def software_reason(self) -> str | None:
        """Why this backend cannot run in this process regardless of the GPU, or None."""
        return None

    def runtime_reason(self) -> str | None:
        """Checks that need the GPU runtime (e.g. torch's kernel availability), or None."""
        return None

    def probe(self, capability: Capability) -> str | None:
        reason = self.software_reason()
        if reason:
            return reason
        if capability is None:
            return "no CUDA GPU visible"
        if self.only_major is not None and capability[0] != self.only_major:
            return (f"needs an sm{self.only_major}x GPU; this one is "
                    f"sm{capability[0]}{capability[1]}")
        if tuple(capability) < self.min_capability:
            return (f"needs compute capability >= {self.min_capability[0]}."
                    f"{self.min_capability[1]}; this GPU has {capability[0]}.{capability[1]}")
        return self.runtime_reason()

    def version(self) -> str | None:
        return None

    def fp8_reason(self) -> str | None:
        """Why this backend takes no FP8 (e4m3) case, or None when it does (then q, k, v arrive
        as fp8_inputs.Fp8Input). Most have no FP8 path: the default says so."""
        return "no FP8 path"

    def mixed_reason(self) -> str | None:
        """Why this backend takes no mixed-mode case (fp16 / bf16 q against FP8 K / V with
        descales), or None when it does (then k and v arrive as fp8_inputs.Fp8Input, q as a
        tensor). Attention libraries take q, k and v of one dtype: the default says so."""
        return "no mixed-mode path: q, k and v must share one dtype"

    def varlen_reason(self) -> str | None:
        """Why this backend takes no varlen case (sequences of different lengths packed along
        one token axis), or None when it does. The default has no such path."""
        return "no varlen path"

    def timing_context(self, case) -> contextlib.AbstractContextManager:
        """A context the timed calls of ``case`` run in (not the checked call); none by
        default."""
        return contextlib.nullcontext()

    def unsupported(self, case, direction: str | None = None) -> str | None:
        """Why this configuration (and direction, when given) cannot be timed, or None."""
        return None

    def make_forward(self, q, k, v, case) -> Callable[[], object]:
        """A callable computing attention on (batch, seqlen, heads, head_dim) tensors; it returns
        the output in the same layout."""
        raise NotImplementedError

    def run_checked(self, q, k, v, case) -> tuple[object, object | None]:
        """One forward of exactly what is timed, for the reference check: (out, lse or None).

        The default runs the timed callable once and has no LSE. A backend that can write into
        caller buffers should override this and fill them with NaN first: a freshly allocated
        output may reuse memory that still holds another backend's correct result, and a kernel
        that writes nothing would then pass.
        """
        return self.make_forward(q, k, v, case)(), None

    def run_checked_backward(self, q, k, v, dout, case) -> tuple[object, object, object]:
        """One forward and backward of exactly what is timed, for the gradient check: (dq, dk,
        dv) for the output gradient ``dout``.

        The default is what the timed backward does: autograd.grad through the timed forward on
        fresh leaves. Gradients come back in fresh tensors, so the same caveat as run_checked's
        applies: a backend that can write into caller buffers should override this with
        NaN-filled ones.
        """
        import torch

        leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
        out = self.make_forward(*leaves, case)()
        return torch.autograd.grad(out, leaves, dout)

    def bwd_workspace_bytes(self, q, k, v, case) -> int | None:
        """Device memory the backward allocates for itself beyond the gradients, by the backend's
        own formula, or None when it has none to report (then only the measurement exists)."""
        return None

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        """(kernel name, why) for what actually runs."""
        return self.name, ""
