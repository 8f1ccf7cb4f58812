"""Dtype arguments outside supports() (tests/test_supports.py has those): the bench helpers and
the CLI take every form flash_hopper._tables.canonical_dtype takes (names, torch dtypes, torch's
spellings, (q, K / V) pairs for the mixed mode) and answer as for the name (CPU)."""

from __future__ import annotations

import pytest
import torch
from flash_hopper import cli
from flash_hopper.bench import cases, fp8_inputs, info, peak


def test_bench_cli_dtype_takes_torch_spellings():
    parsed = cli.build_parser().parse_args(
        ["bench", "--dtype", "bfloat16", "torch.float16", "float8_e4m3fn", "bf16+e4m3",
         "bfloat16+float8_e5m2"])
    assert parsed.dtype == ["bf16", "fp16", "e4m3", "bf16+e4m3", "bf16+e5m2"]
    for command in ("info", "demo"):
        assert cli.build_parser().parse_args([command, "--dtype", "torch.bfloat16"]).dtype == "bf16"


@pytest.mark.parametrize("command, value, message", [
    ("bench", "float8", "argument --dtype: expected one of fp16, bf16, e4m3, bf16+e4m3"),
    ("bench", "float8", "got 'float8'"),
    # info takes 16-bit dtypes: argparse's choices check the converted name
    ("info", "float8_e4m3fn", "argument --dtype: invalid choice: 'e4m3'"),
])
def test_cli_dtype_errors_name_the_option_and_value(capsys, command, value, message):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--dtype", value])
    err = capsys.readouterr().err
    assert message in err, err


def test_cases_take_torch_dtypes():
    case = cases.Case(batch=1, seqlen_q=8, seqlen_k=8, heads=2, heads_kv=1, head_dim=64,
                      dtype=(torch.bfloat16, torch.float8_e5m2))
    assert (case.dtype, case.q_dtype, case.kv_dtype, case.is_mixed) == (
        "bf16+e5m2", "bf16", "e5m2", True)
    assert cases.gemm_dtype(torch.float8_e4m3fn) == "e4m3"
    with pytest.raises(ValueError, match="^dtype: expected one of .* got torch.float32$"):
        cases.Case(batch=1, seqlen_q=8, seqlen_k=8, heads=2, heads_kv=1, head_dim=64,
                   dtype=torch.float32)


def test_peak_lookup_takes_torch_dtypes():
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak.lookup_peak(h100, torch.float8_e4m3fn) == peak.lookup_peak(h100, "e4m3")
    assert peak.lookup_peak(h100, (torch.float16, torch.float8_e4m3fn)) == \
        peak.lookup_peak(h100, "fp16")


def test_kv_cache_quantization_takes_torch_fp8_dtypes():
    k, v = torch.randn(2, 1, 16, 2, 64).unbind(0)
    for form in (torch.float8_e5m2, "float8_e5m2", "e5m2"):
        k8, v8 = fp8_inputs.quantize_kv_cache(k, v, form)
        assert k8.data.dtype == v8.data.dtype == torch.float8_e5m2, form
    with pytest.raises(ValueError, match="^dtype: expected an FP8 K / V dtype, one of e4m3, e5m2, "
                                         "torch.float8_e4m3fn, torch.float8_e5m2, got "
                                         "torch.bfloat16$"):
        fp8_inputs.quantize_kv_cache(k, v, torch.bfloat16)


def test_info_paths_take_torch_dtypes(lib):
    assert info.path_hypothetical((9, 0), 128, torch.bfloat16, "auto", False) == \
        info.path_hypothetical((9, 0), 128, "bf16", "auto", False)
