"""Selects a deterministic sample of FA3's test_flash_attn_varlen_output to run against flash_hopper.

Kept (from the items pytest collected, after -k / -m):
  - test function test_flash_attn_varlen_output only (every other test is deselected),
  - dtype == torch.bfloat16, has_qv == False,
  - d in FA3_HDIMS (env, comma list, default "64,128").
    Note: dv is not a parameter of this test; it loops inside the test over
    dv_vals = [256, 512, d] when d <= 64 (forward for all three; backward for dv <= 256), and
    [d] for d = 128. So a d=64 item also calls flash_attn_varlen_func with dv=256 and dv=512
    (flash_hopper serves dv != d by zero-padding q/k to width 256: needs the d256 kernel).
    Use FA3_HDIMS=128 if the build has no head-dim-256 kernel.
Then FA3_SAMPLE (env, default 40; 0 or "all" = keep every filtered item) items are picked:
the filtered items sorted by nodeid, then a seeded pseudo-random choice (FA3_SEED, default 0)
of FA3_SAMPLE of them, run in nodeid order. Same env -> same items on every machine.

CPU-only collection: the test module calls torch.cuda.get_device_capability("cuda") at import
time (for DISABLE_FP8). When CUDA is not available, and only then, that function is replaced by
one returning (9, 0) (an H100's) so collection works on a machine without a GPU. With a GPU
nothing is patched.
"""

import os
import random

import pytest
import torch

TARGET = "test_flash_attn_varlen_output"

if not torch.cuda.is_available():  # collection on a CPU-only machine; no effect with a GPU
    torch.cuda.get_device_capability = lambda device=None: (9, 0)


def _hdims():
    raw = os.getenv("FA3_HDIMS", "64,128")
    return {int(x) for x in raw.replace(" ", "").split(",") if x}


def _sample_size():
    raw = os.getenv("FA3_SAMPLE", "40").strip().lower()
    if raw in ("", "all", "0"):
        return None
    return int(raw)


_summary = {}


def _keep(item, hdims):
    if getattr(item, "originalname", item.name.split("[")[0]) != TARGET:
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("dtype") is not torch.bfloat16:
        return False
    if params.get("has_qv", False):
        return False
    if "d" not in params or params["d"] not in hdims:
        return False
    return "dv" not in params or params["dv"] == params["d"]


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    hdims = _hdims()
    n = _sample_size()
    seed = int(os.getenv("FA3_SEED", "0"))
    total = len(items)
    target = [it for it in items if getattr(it, "originalname", "") == TARGET]
    kept = sorted((it for it in items if _keep(it, hdims)), key=lambda it: it.nodeid)
    if n is not None and n < len(kept):
        idx = sorted(random.Random(seed).sample(range(len(kept)), n))
        chosen = [kept[i] for i in idx]
    else:
        chosen = kept
    chosen_ids = {id(it) for it in chosen}
    deselected = [it for it in items if id(it) not in chosen_ids]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = chosen
    _summary.update(total=total, target=len(target), kept=len(kept), sampled=len(chosen),
                    hdims=sorted(hdims), sample=n, seed=seed)
    msg = (f"fa3tests: collected {total} items ({len(target)} {TARGET}); "
           f"filtered to {len(kept)} (bf16, has_qv=False, d in {sorted(hdims)}); "
           f"sampled {len(chosen)} (FA3_SAMPLE={n if n is not None else 'all'}, FA3_SEED={seed})")
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(msg)
    else:
        print(msg)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _summary:
        s = _summary
        terminalreporter.write_line(
            f"fa3tests: collected {s['total']}, {TARGET} {s['target']}, filtered {s['kept']}, "
            f"sampled {s['sampled']} (d in {s['hdims']}, FA3_SEED={s['seed']})")
