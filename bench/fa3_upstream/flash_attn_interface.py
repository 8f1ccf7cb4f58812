"""Shim: FA3's `flash_attn_interface` module, served by flash_hopper.

FA3's hopper/test_flash_attn.py does
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_combine
    from flash_attn_interface import flash_attn_with_kvcache, get_scheduler_metadata
This file re-exports those names (plus flash_attn_qkvpacked_func, the other public function of
FA3's interface) from flash_hopper, unchanged. Nothing is reimplemented here.

Not provided: FA3's private helpers (_flash_attn_forward / _flash_attn_backward, the
autograd.Function classes) and the torch.ops.flash_attn_3 namespace (used only by
test_flash3_bw_compatibility, which checks FA3's own op schemas).
"""

from flash_hopper import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
)

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]
