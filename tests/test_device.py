"""Device queries: cuda-python first, torch.cuda as fallback, a clear error when neither works."""

from __future__ import annotations

import types

import pytest
import torch
from flash_hopper import DeviceQueryError, _device


@pytest.fixture(autouse=True)
def _fresh_cache():
    _device.device_info.cache_clear()
    yield
    _device.device_info.cache_clear()


H100_ATTRIBUTES = {"major": 9, "minor": 0, "sms": 132, "smem": 232448}


class FakeDriver:
    """The slice of cuda-python's driver API that _device uses, answering like an H100."""

    __name__ = "cuda.bindings.driver"

    class CUresult(int):
        pass

    CUdevice_attribute = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="sms",
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="smem",
    )
    def __init__(self, init_error=0):
        self.init_error = init_error

    def cuInit(self, flags):
        return (self.init_error,)

    def cuDeviceGetCount(self):
        return 0, 2

    def cuDeviceGet(self, index):
        return 0, index

    def cuDeviceGetAttribute(self, attribute, device):
        return 0, H100_ATTRIBUTES[attribute]

    def cuDeviceGetName(self, length, device):
        return 0, b"NVIDIA H100 80GB HBM3\x00\x00\x00"

    def cuDriverGetVersion(self):
        return 0, 12040

    def cuGetErrorString(self, result):
        return 0, b"no CUDA-capable device is detected"


def test_query_through_cuda_python(monkeypatch):
    monkeypatch.setattr(_device, "_driver_module", FakeDriver)
    info = _device.device_info(1)
    assert info.index == 1 and info.name == "NVIDIA H100 80GB HBM3"
    assert info.capability == (9, 0) and info.sm_count == 132
    assert info.max_smem_per_block_optin == 232448
    assert info.driver_version == 12040 and info.source == "cuda.bindings"
    assert _device.driver_version() == (12, 4)


def test_results_are_cached_per_device(monkeypatch):
    monkeypatch.setattr(_device, "_driver_module", FakeDriver)
    assert _device.device_info(0) is _device.device_info(0)
    assert _device.device_info(0) is not _device.device_info(1)


def test_bad_device_index(monkeypatch):
    monkeypatch.setattr(_device, "_driver_module", FakeDriver)
    monkeypatch.setattr(_device, "_query_torch", _raise("torch.cuda: not asked"))
    with pytest.raises(DeviceQueryError, match="device index 5 out of range: 2 CUDA device"):
        _device.device_info(5)


def _raise(message):
    def fail(*args, **kwargs):
        raise DeviceQueryError(message)

    return fail


def test_failing_driver_falls_back_to_torch_and_reports_both(monkeypatch):
    monkeypatch.setattr(_device, "_driver_module", lambda: FakeDriver(init_error=100))
    monkeypatch.setattr(_device, "_query_torch", _raise("torch.cuda.is_available() is False"))
    with pytest.raises(DeviceQueryError) as info:
        _device.device_info(0)
    message = str(info.value)
    assert "cuInit failed" in message and "(100)" in message
    assert "no CUDA-capable device is detected" in message
    assert "torch.cuda.is_available() is False" in message


def test_without_cuda_python_torch_answers(monkeypatch):
    props = types.SimpleNamespace(name="NVIDIA A100", major=8, minor=0,
                                  multi_processor_count=108,
                                  shared_memory_per_block_optin=166912)
    monkeypatch.setattr(_device, "_driver_module", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    info = _device.device_info(0)
    assert (info.name, info.capability, info.sm_count) == ("NVIDIA A100", (8, 0), 108)
    assert info.max_smem_per_block_optin == 166912
    assert info.driver_version is None and info.source == "torch.cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_only_machine_raises_a_clear_error():
    with pytest.raises(DeviceQueryError, match="cannot query CUDA device 0"):
        _device.device_info(0)


def test_cu_error_message_works_without_a_driver():
    driver = pytest.importorskip("cuda.bindings.driver")
    message = _device.cu_error_message(driver.CUresult.CUDA_ERROR_NO_DEVICE)
    assert message.startswith("CUDA_ERROR_NO_DEVICE (100)")


@pytest.mark.gpu
def test_real_device_matches_torch():
    index = torch.cuda.current_device()
    info = _device.device_info(index)
    props = torch.cuda.get_device_properties(index)
    assert info.capability == torch.cuda.get_device_capability(index)
    assert info.sm_count == props.multi_processor_count
    assert info.name == props.name
    assert info.max_smem_per_block_optin is None or info.max_smem_per_block_optin >= 48 * 1024
