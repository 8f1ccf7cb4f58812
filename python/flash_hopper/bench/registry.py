"""Every benchmark backend by name: flash-hopper's paths (backends.py), the fa3 variants the
loaded library reports, and the peers (peers.py). The only module that imports both, so neither
needs the other."""

from __future__ import annotations

from collections.abc import Sequence

from . import peers
from .backends import FP8_SINGLE_LEVEL, FlashHopperBackend, variant_names
from .base import Backend

DEFAULT_BACKENDS = ("fa3", "fa2", "sdpa-flash", "sdpa-cudnn")
# Module-style spellings people will type, mapped to backend names.
ALIASES = {
    "flash_attn": "flash-attn",
    "flash-attn2": "flash-attn",
    "flash_attn_interface": "flash-attn3",
    "flash_attn_3": "flash-attn3",
    "fa3_fwd_interface": "flash-attn3",
    "fa3-fwd": "flash-attn3",
    "flash_attn.cute": "flash-attn-cute",
    "sdpa": "sdpa-flash",
    "cudnn": "sdpa-cudnn",
    "flashinfer-python": "flashinfer",
}


def _builtin_backends() -> dict[str, Backend]:
    backends: dict[str, Backend] = {
        "fa3": FlashHopperBackend("fa3", "fa3"),
        "fa2": FlashHopperBackend("fa2", "fa2"),
        # FP8 ablation: the fa3 path with single-level accumulation (e4m3 cases only).
        FP8_SINGLE_LEVEL: FlashHopperBackend(FP8_SINGLE_LEVEL, "fa3",
                                             fp8_accumulation="single-level"),
    }
    for kind in peers.SDPA_KINDS:
        backend = peers.SdpaBackend(kind)
        backends[backend.name] = backend
    backends["flex"] = peers.FlexBackend()
    for backend in peers.external_backends():
        backends[backend.name] = backend
    return backends


def known_backends(include_variants: bool = True) -> dict[str, Backend]:
    """All known backends by name, plus the fa3 variants the loaded library reports."""
    backends = _builtin_backends()
    if include_variants:
        try:
            import flash_hopper

            info = dict(flash_hopper.build_info())
        except Exception:  # noqa: BLE001 - no library: no variants; fa3/fa2 report why
            info = {}
        for variant in variant_names(info):
            backends[variant] = FlashHopperBackend(variant, variant, variant=True)
    return backends


def canonical_name(name: str) -> str:
    return ALIASES.get(name, name)


def resolve(names: Sequence[str], known: dict[str, Backend] | None = None,
            dtypes: Sequence[str] | None = None) -> list[Backend]:
    """Backends for CLI names, in the given order; 'all' expands to every known backend, less
    those limited to dtypes (Backend.only_dtypes) that the sweep's ``dtypes`` do not include (the
    FP8 ablation in a bf16 sweep); a backend asked for by name is always kept.

    An unknown name starting with 'fa3' is kept as a variant (it then probes as unavailable, with
    the build's variant list as the reason) so a script asking for an ablation does not crash on
    a build without it; any other unknown name is a usage error.
    """
    known = known_backends() if known is None else known
    chosen: list[Backend] = []
    for raw in names:
        if raw == "all":
            candidates = [b for b in known.values() if dtypes is None or b.only_dtypes is None
                          or set(b.only_dtypes) & set(dtypes)]
        else:
            name = canonical_name(raw)
            if name in known:
                candidates = [known[name]]
            elif name.startswith("fa3"):
                candidates = [FlashHopperBackend(name, name, variant=True)]
            else:
                raise ValueError(f"unknown backend {raw!r}; known: {', '.join(known)}, all")
        for backend in candidates:
            if all(b.name != backend.name for b in chosen):
                chosen.append(backend)
    return chosen
