"""``device: auto`` (trainer/launch/device.py) on a GPU machine, proven on a CPU with a fake ``pynvml`` that follows
nvidia-ml-py's API (pynvml.py: ``nvmlInit`` raises ``NVMLError_LibraryNotFound`` / ``NVMLError_DriverNotLoaded``
where there is no driver; ``nvmlDeviceGetCount`` counts the devices NVML sees, ``CUDA_VISIBLE_DEVICES`` aside)."""

import sys
import types

import pytest

from trainer.launch.device import detect_device


def _fake_pynvml(monkeypatch, *, count: int = 0, init_error: Exception | None = None) -> types.ModuleType:
    calls: list[str] = []
    mod = types.ModuleType("pynvml")

    def nvmlInit():
        calls.append("init")
        if init_error is not None:
            raise init_error

    mod.nvmlInit = nvmlInit
    mod.nvmlDeviceGetCount = lambda: calls.append("count") or count
    mod.nvmlShutdown = lambda: calls.append("shutdown")
    mod.calls = calls
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return mod


def test_auto_is_cuda_when_nvml_sees_a_device_and_nvml_is_shut_down_after(monkeypatch):
    nvml = _fake_pynvml(monkeypatch, count=8)
    assert detect_device("auto") == "cuda"
    assert nvml.calls == ["init", "count", "shutdown"]


@pytest.mark.parametrize("count, error", [(0, None), (0, RuntimeError("NVML Shared Library Not Found"))])
def test_auto_is_cpu_without_a_device_or_a_driver(monkeypatch, count, error):
    _fake_pynvml(monkeypatch, count=count, init_error=error)
    assert detect_device("auto") == "cpu"


def test_a_named_device_is_taken_as_named(monkeypatch):
    nvml = _fake_pynvml(monkeypatch, count=8)
    assert detect_device("cpu") == "cpu" and nvml.calls == []
