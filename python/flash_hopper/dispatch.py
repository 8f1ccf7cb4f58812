"""Backend policy: which kernel path serves a request, and why. Pure: no GPU, no library.

The inputs are the facts (GPU compute capability, which kernels this build instantiated) so the
policy is testable with any mocked capability and build set; ops.py supplies the real facts.

- "fa3" is the FA-3 path (TMA + WGMMA, sm90a code): sm90a instructions exist only on
  compute capability 9.0 exactly, so it never runs on 8.x nor on 10.x/12.x.
- "fa2" is the FA-2 path (cp.async + mma.sync, sm80 code), runnable on every cc >= 8.0.
- "auto" prefers fa3 where it can run and is built, else fa2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Union

from ._errors import UnsupportedError

HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
# Ablation variants of the FA-3 path (FhVariant in api.h): the same kernels with ping-pong
# scheduling and/or intra-warpgroup overlap switched off, for the FA3 paper's ablation.
# Values are FhVariant (api.h).
FA3_VARIANTS = {"fa3-no-pingpong": 1, "fa3-no-overlap": 2, "fa3-no-pingpong-no-overlap": 3}
BACKENDS = ("auto", "fa2", "fa3", *FA3_VARIANTS)

# Value of the FH_ARCHS build variable that compiles each path's kernels.
_BUILD_ARCH = {"fa2": "80", "fa3": "90a"}

# built(backend, dtype, bucket) -> bool, or a collection of (backend, dtype, bucket) tuples.
Built = Union[Callable[[str, str, int], bool], Iterable[tuple[str, str, int]]]


def head_dim_bucket(head_dim: int) -> int:
    """Smallest instantiated head-dim bucket >= head_dim (a kernel pads d up to its bucket)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(
        f"head_dim: expected at most {HEAD_DIM_BUCKETS[-1]}, got {head_dim}"
    )


def _as_predicate(built: Built) -> Callable[[str, str, int], bool]:
    if callable(built):
        return built
    kernels = frozenset(built)
    return lambda backend, dtype, bucket: (backend, dtype, bucket) in kernels


def _rebuild_hint(backend: str, dtype: str, bucket: int) -> str:
    return (
        f"rebuild with FH_ARCHS including {_BUILD_ARCH[backend]}, FH_HEAD_DIMS including "
        f"{bucket} and FH_DTYPES including {dtype}"
    )


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def select_backend(
    requested: str,
    capability: tuple[int, int],
    built: Built,
    dtype: str,
    head_dim: int,
    fa3_layout_problem: str | None = None,
) -> tuple[str, str]:
    """Pick "fa2" or "fa3" for (dtype, head_dim) on a GPU of ``capability``.

    ``fa3_layout_problem`` (``_validate.tma_layout_problem``): why the fa3 path cannot load the
    call's tensors, if it cannot; "auto" then runs fa2 and "fa3" raises with that reason.

    Returns (backend, reason); the reason says why, for logs and ``flash-hopper info``.
    Raises ValueError for an unknown ``requested`` name and UnsupportedError (a
    NotImplementedError) when nothing in this build can run the request on this GPU.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested in FA3_VARIANTS:
        # The variant kernels are fa3 kernels: same device rule; the library checks that this
        # variant was built for (dtype, head dim) and names FH_FA3_ABLATION_* if not.
        _name, reason = select_backend(
            "fa3", capability, built, dtype, head_dim, fa3_layout_problem
        )
        return requested, reason.replace("fa3 requested", f"{requested} requested", 1)
    capability = (int(capability[0]), int(capability[1]))
    has = _as_predicate(built)
    bucket = head_dim_bucket(head_dim)
    what = f"{dtype} hdim {head_dim}" + (f" (bucket {bucket})" if bucket != head_dim else "")
    cc = _cc(capability)
    fa3_runs = capability == (9, 0)
    fa2_runs = capability >= (8, 0)
    fa3_built = has("fa3", dtype, bucket)
    fa2_built = has("fa2", dtype, bucket)

    if requested == "fa3":
        if not fa3_runs:
            raise UnsupportedError(
                f"backend='fa3' needs a GPU of compute capability 9.0 (H100/H200: sm90a code "
                f"runs on 9.0 only), this GPU is cc {cc}; use backend='fa2' or 'auto'"
            )
        if not fa3_built:
            raise UnsupportedError(
                f"backend='fa3': this build has no fa3 kernel for {what}; "
                f"{_rebuild_hint('fa3', dtype, bucket)}, or use backend='auto'"
            )
        if fa3_layout_problem:
            raise UnsupportedError(
                f"backend='fa3': {fa3_layout_problem}, or use backend='fa2' or 'auto'"
            )
        return "fa3", f"fa3 requested; cc {cc} and fa3 kernel built for {what}"

    if requested == "fa2":
        if not fa2_runs:
            raise UnsupportedError(
                f"backend='fa2' needs a GPU of compute capability >= 8.0 (sm80 code), "
                f"this GPU is cc {cc}"
            )
        if not fa2_built:
            raise UnsupportedError(
                f"backend='fa2': this build has no fa2 kernel for {what}; "
                f"{_rebuild_hint('fa2', dtype, bucket)}"
            )
        return "fa2", f"fa2 requested; cc {cc} and fa2 kernel built for {what}"

    # auto
    if fa3_runs and fa3_built and not fa3_layout_problem:
        return "fa3", f"cc {cc} and fa3 kernel built for {what} -> fa3"
    if not fa2_runs:
        raise UnsupportedError(
            f"flash-hopper needs a GPU of compute capability >= 8.0 (FA-2 path) or 9.0 (FA-3 "
            f"path), this GPU is cc {cc}"
        )
    if not fa2_built and fa3_runs and fa3_built:  # only the layout keeps fa3 out
        raise UnsupportedError(
            f"{fa3_layout_problem}; this build has no fa2 kernel for {what} to run it instead "
            f"({_rebuild_hint('fa2', dtype, bucket)})"
        )
    if not fa2_built:
        missing = "fa3 or fa2" if fa3_runs else "fa2"
        hint = _rebuild_hint("fa3" if fa3_runs else "fa2", dtype, bucket)
        raise UnsupportedError(
            f"cc {cc}: this build has no {missing} kernel for {what}; {hint}"
        )
    if fa3_runs and fa3_built:
        why = f"cc {cc} but {fa3_layout_problem}"
    elif fa3_runs:
        why = f"cc {cc} but this build has no fa3 kernel for {what}"
    else:
        why = f"cc {cc}: fa3 needs cc 9.0 (sm90a)"
    return "fa2", f"{why} -> fa2"
