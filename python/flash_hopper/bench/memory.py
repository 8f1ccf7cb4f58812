"""Device memory of a backward call beyond its inputs and outputs, per config.

Two numbers for rows that time a backward:

- ``bwd_workspace_bytes``: what the backend's own formula says it allocates, where it has one
  (flash-hopper: fh_bwd_workspace_size, the fp32 dQ accumulator, dK / dV accumulators under GQA,
  the D and LSE rows; Backend.bwd_workspace_bytes);
- ``bwd_extra_bytes``: measured for every backend on the call that is timed (autograd.grad through
  its forward): torch.cuda.max_memory_allocated during one backward, minus what was allocated
  before it and the bytes of the three gradients it returns. It counts whatever the backward
  allocates through torch's allocator (workspace, copies of dout, GQA expansions), and nothing a
  backend allocates outside torch (cuDNN's own workspace is torch's; an external package's may
  not be).
"""

from __future__ import annotations

from .errors import first_line


def measure_bwd_extra_bytes(backend, inputs, dout, case) -> int:
    """bwd_extra_bytes of one backward of ``backend`` on ``inputs`` (q, k, v on a CUDA device)."""
    import torch

    device = inputs[0].device
    leaves = tuple(t.detach().requires_grad_(True) for t in inputs)
    out = backend.make_forward(*leaves, case)()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak - before - sum(g.numel() * g.element_size() for g in grads)


def bwd_memory(backend, inputs, dout, case) -> tuple[dict[str, int | None], str | None]:
    """({"bwd_workspace_bytes", "bwd_extra_bytes"}, a note saying what could not be measured or
    None). Nothing is measured off a CUDA device (the CPU stand-ins of the tests)."""
    memory: dict[str, int | None] = {"bwd_workspace_bytes": None, "bwd_extra_bytes": None}
    if inputs[0].device.type != "cuda":
        return memory, None
    notes = []
    try:
        memory["bwd_workspace_bytes"] = backend.bwd_workspace_bytes(*inputs, case)
    except Exception as exc:  # noqa: BLE001 - a missing number must not cost the timing
        notes.append(f"bwd workspace size unavailable: {first_line(exc)}")
    try:
        memory["bwd_extra_bytes"] = measure_bwd_extra_bytes(backend, inputs, dout, case)
    except Exception as exc:  # noqa: BLE001 - OOM included: the timing says more
        notes.append(f"bwd memory not measured: {first_line(exc)}")
    return memory, "; ".join(notes) or None
