"""``gpu_info`` (what search and fit read of a GPU: its name and memory) names the device CUDA_VISIBLE_DEVICES' entry
is to CUDA, over test_memory_nvml.py's fake ``pynvml`` (nvidia-ml-py's API and NVML's PCI-bus order, named there):
index 0 on a T4 + A100 node is CUDA's fastest device, whatever NVML's index 0 is."""

from tests.tuner.trials.test_memory_nvml import A100, T4, nvml  # noqa: F401 - nvml is the fixture
from tuner.trials import memory


def test_gpu_info_reads_the_device_cuda_names(nvml):  # noqa: F811
    nvml(T4, A100)  # NVML's index 0 is the T4 (the lower PCI bus id)
    name, total_gb = memory.gpu_info("0")
    assert name == A100.name and total_gb == 80.0
    assert memory.gpu_info(A100.uuid[:12]) == (A100.name, 80.0)  # a UUID prefix, as CUDA takes it


def test_gpu_info_without_nvml_says_nothing(monkeypatch):
    monkeypatch.setattr(memory, "_nvml_ok", False)
    assert memory.gpu_info("0") == (None, None)
