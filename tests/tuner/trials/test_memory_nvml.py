"""CUDA_VISIBLE_DEVICES entries found in NVML as CUDA reads them (tuner.trials.memory.resolve_gpus), on a CPU.

The fake ``pynvml`` below has nvidia-ml-py's names and return shapes (``pynvml.py`` of nvidia-ml-py 13:
``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetHandleByUUID``, ``nvmlDeviceGetUUID``,
``nvmlDeviceGetPciInfo`` (an ``nvmlPciInfo_t``: ``domain``, ``bus``, ``device``, ``busId``),
``nvmlDeviceGetCudaComputeCapability`` (``(major, minor)``), ``nvmlDeviceGetMigMode`` (``[current, pending]``),
``nvmlDeviceGetMaxMigDeviceCount``, ``nvmlDeviceGetMigDeviceHandleByIndex``, ``nvmlDeviceGetGpuInstanceId``,
``nvmlDeviceGetComputeInstanceId``) and NVML's behaviour: devices indexed in PCI bus order (as nvidia-smi lists
them), ``nvmlDeviceGetHandleByUUID`` taking a whole UUID only, ``nvmlDeviceGetMigMode`` raising NOT_SUPPORTED on a
GPU without MIG, an empty MIG slot raising NOT_FOUND.

What CUDA makes of an entry is the CUDA Programming Guide's "CUDA Environment Variables" (CUDA_VISIBLE_DEVICES:
indices are CUDA ordinals, a UUID may be cut to a unique prefix, an invalid entry ends the list, MIG-<uuid> and
MIG-GPU-<uuid>/<gi>/<ci>; CUDA_DEVICE_ORDER: FASTEST_FIRST by default, PCI_BUS_ID "by PCI bus ID in ascending
order"), and torch's mirror of the driver's parser (torch/cuda/__init__.py::_parse_visible_devices,
::_transform_uuid_to_ordinals: a prefix matching two UUIDs is invalid).
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field

import pytest

from tuner.trials import memory

NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_FOUND = 3, 6  # nvml.h's nvmlReturn_t values (pynvml's constants)


@dataclass
class _Dev:
    uuid: str
    name: str
    bus: int
    cc: tuple
    mig: list = field(default_factory=list)  # [(uuid, gpu instance id, compute instance id)]


class _PciInfo:
    def __init__(self, bus: int) -> None:
        self.domain, self.bus, self.device = 0, bus, 0
        self.busId = f"00000000:{bus:02X}:00.0"


class _Mem:
    def __init__(self, used: int) -> None:
        self.used, self.total, self.free = used, 80 << 30, (80 << 30) - used


def fake_pynvml(devices: list[_Dev]) -> types.ModuleType:
    """nvidia-ml-py's API over ``devices``, indexed as NVML does: in PCI bus order."""
    nv = types.ModuleType("pynvml")
    devs = sorted(devices, key=lambda d: d.bus)
    migs = {m[0]: (d, m) for d in devs for m in d.mig}

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    nv.NVMLError = NVMLError
    nv.NVML_DEVICE_MIG_ENABLE = 1
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetCount = lambda: len(devs)

    def by_index(i: int):
        if not 0 <= i < len(devs):
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return ("gpu", devs[i].uuid)

    def by_uuid(uuid: str):  # a whole UUID, never a prefix
        if any(d.uuid == uuid for d in devs):
            return ("gpu", uuid)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def dev(h) -> _Dev:
        return next(d for d in devs if d.uuid == h[1]) if h[0] == "gpu" else migs[h[1]][0]

    def mig_mode(h):
        if not dev(h).mig:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [1, 1]

    def mig_by_index(h, i: int):
        d = dev(h)
        if i >= len(d.mig):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return ("mig", d.mig[i][0])

    nv.nvmlDeviceGetHandleByIndex = by_index
    nv.nvmlDeviceGetHandleByUUID = by_uuid
    nv.nvmlDeviceGetUUID = lambda h: h[1]
    nv.nvmlDeviceGetName = lambda h: dev(h).name
    nv.nvmlDeviceGetPciInfo = lambda h: _PciInfo(dev(h).bus)
    nv.nvmlDeviceGetCudaComputeCapability = lambda h: dev(h).cc
    nv.nvmlDeviceGetMigMode = mig_mode
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    nv.nvmlDeviceGetMigDeviceHandleByIndex = mig_by_index
    nv.nvmlDeviceGetGpuInstanceId = lambda m: migs[m[1]][1][1]
    nv.nvmlDeviceGetComputeInstanceId = lambda m: migs[m[1]][1][2]
    nv.nvmlDeviceGetMemoryInfo = lambda h: _Mem(1 << 30)
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: []
    return nv


T4 = _Dev("GPU-11111111-aaaa-4000-8000-000000000001", "Tesla T4", 0x1A, (7, 5))
A100 = _Dev("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "NVIDIA A100-SXM4-80GB", 0x3B, (8, 0))
A100_B = _Dev("GPU-8932f9aa-0000-4000-8000-000000000003", "NVIDIA A100-SXM4-80GB", 0x5E, (8, 0))
MIG_GPU = _Dev(
    "GPU-77777777-0000-4000-8000-000000000007",
    "NVIDIA A100-SXM4-80GB",
    0x86,
    (8, 0),
    mig=[("MIG-aaaa1111-0000-5000-8000-000000000001", 1, 0), ("MIG-bbbb2222-0000-5000-8000-000000000002", 2, 0)],
)


@pytest.fixture
def nvml(monkeypatch):
    """Install a fake pynvml over the given devices; CUDA_DEVICE_ORDER unset."""
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)

    def install(*devices: _Dev) -> types.ModuleType:
        nv = fake_pynvml(list(devices))
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        monkeypatch.setattr(memory, "_nvml_ok", None)
        return nv

    return install


def _uuids(handles) -> list[str]:
    return [h[1] for h in handles]


def test_an_index_is_cudas_fastest_first_ordinal_not_nvmls_index(nvml):
    """The slower GPU sits on the lower PCI bus: NVML's index 0 (and PCI_BUS_ID's ordinal 0) is the T4, CUDA's
    default FASTEST_FIRST ordinal 0 the A100 (compute capability 8.0 > 7.5). A mixed node's order is a guess: noted."""
    nvml(T4, A100)
    r = memory.resolve_visible(["0"])
    assert _uuids(r.handles) == [A100.uuid]
    assert len(r.notes) == 1 and "FASTEST_FIRST" in r.notes[0] and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in r.notes[0]


def test_an_index_under_pci_bus_id_is_the_pci_order(nvml, monkeypatch):
    nvml(T4, A100)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    r = memory.resolve_visible(["1", "0"])
    assert _uuids(r.handles) == [A100.uuid, T4.uuid] and r.notes == []


def test_one_model_has_one_order_without_a_note(nvml):
    nvml(A100, A100_B)
    r = memory.resolve_visible(["1"])
    assert _uuids(r.handles) == [A100_B.uuid] and r.notes == []


def test_full_uuid_and_a_unique_prefix(nvml):
    """CUDA accepts "GPU-8932f937" for GPU-8932f937-d72c-...: NVML's nvmlDeviceGetHandleByUUID does not."""
    nvml(T4, A100)
    r = memory.resolve_visible([A100.uuid, "GPU-1111"])
    assert _uuids(r.handles) == [A100.uuid, T4.uuid] and r.notes == []
    r = memory.resolve_visible(["GPU-8932f937"])
    assert _uuids(r.handles) == [A100.uuid] and r.notes == []


def test_a_uuid_without_its_prefix(nvml):
    """Read like strtoul (torch's _strtoul mirrors the driver), "8932f937" is CUDA's ordinal 8932; one that starts
    with a letter is matched in its GPU- form, with a note: CUDA documents UUIDs with the prefix."""
    nvml(T4, A100, _Dev("GPU-c0ffee00-0000-4000-8000-000000000009", "NVIDIA A100-SXM4-80GB", 0x90, (8, 0)))
    r = memory.resolve_visible(["8932f937"])
    assert r.handles == [] and "no CUDA device 8932 among 3" in r.notes[0]
    r = memory.resolve_visible(["c0ffee"])
    assert _uuids(r.handles) == ["GPU-c0ffee00-0000-4000-8000-000000000009"]
    assert len(r.notes) == 1 and "read as GPU-c0ffee" in r.notes[0]


def test_an_ambiguous_prefix_resolves_nothing_and_says_so(nvml):
    """torch's _transform_uuid_to_ordinals: a prefix of two UUIDs is invalid, and it ends the list."""
    nvml(T4, A100, A100_B)
    r = memory.resolve_visible(["GPU-8932f9", "GPU-1111"])
    assert r.handles == []
    assert len(r.notes) == 1
    assert "GPU-8932f9: ambiguous" in r.notes[0] and A100.uuid in r.notes[0] and A100_B.uuid in r.notes[0]
    assert "GPU-1111 after it" in r.notes[0]


def test_mig_devices_by_uuid_and_cuda_11_form_an_index_noted(nvml):
    nvml(A100, MIG_GPU)
    r = memory.resolve_visible(["MIG-bbbb", "MIG-GPU-77777777-0000-4000-8000-000000000007/1/0"])
    assert r.handles == [("mig", MIG_GPU.mig[1][0]), ("mig", MIG_GPU.mig[0][0])] and r.notes == []
    r = memory.resolve_visible(["GPU-7777"])  # the MIG-mode GPU itself: CUDA sees its MIG devices, not it
    assert r.handles == [] and "MIG mode" in r.notes[0]
    r = memory.resolve_visible(["1"])  # ordinal 1 (PCI order among one model) is the MIG-mode GPU
    assert r.handles == [] and "MIG mode" in r.notes[0]


def test_a_negative_index_ends_the_visible_list(monkeypatch):
    """The guide's own example: CUDA_VISIBLE_DEVICES=0,2,-1,1 makes devices 0 and 2 visible."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,-1,1")
    assert memory.visible_gpus() == ["0", "2"]


def test_the_sampler_reads_a_prefix_through_nvml_and_notes_what_it_cannot(nvml):
    nvml(T4, A100, A100_B)
    s = memory.MemorySampler(os.getpid(), gpus=["GPU-8932f937"])
    assert s.source == "nvml" and s.peaks.notes == []
    s = memory.MemorySampler(os.getpid(), gpus=["GPU-8932f9"])
    assert s.source == "psutil"
    assert any("ambiguous" in n for n in s.peaks.notes) and any("psutil" in n for n in s.peaks.notes)
    s._sample()
    assert "ambiguous" in " ".join(s.stop().notes)
