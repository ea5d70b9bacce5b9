"""What a GPU model can do, from its vendor's data sheet: dense peak FLOP/s (bf16 tensor cores; fp32 with TF32 off,
torch's default for matmuls, which verl keeps) and HBM bandwidth. One table, torch-free: the trainer's MFU
(trainer.engine.metrics) and the tuner's trial-time estimate (tuner.search.trial_time) read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["DeviceSpec", "DEVICE_SPECS", "device_spec", "peak_flops"]


@dataclass(frozen=True)
class DeviceSpec:
    key: str  # the fragment of the device's name it matched (upper case)
    bf16_flops: float  # dense, tensor cores
    fp32_flops: float  # dense, TF32 off
    hbm_bytes_per_s: float

    def flops(self, dtype: str = "bfloat16") -> float:
        return self.fp32_flops if dtype in ("float32", "fp32") else self.bf16_flops


#: matched in order against the upper-cased device name: a PCIe H100 (slower memory, lower clocks) before the SXM one
DEVICE_SPECS = tuple(
    DeviceSpec(*row)
    for row in (
        ("H100 PCIE", 756e12, 51e12, 2.0e12),
        ("H200", 989e12, 67e12, 4.8e12),
        ("H100", 989e12, 67e12, 3.35e12),
        ("H800", 989e12, 67e12, 3.35e12),
        ("A100", 312e12, 19.5e12, 2.0e12),
        ("A800", 312e12, 19.5e12, 2.0e12),
        ("L40S", 362e12, 91.6e12, 0.864e12),
        ("A10", 125e12, 31.2e12, 0.6e12),
        ("L4", 121e12, 30.3e12, 0.3e12),
        ("4090", 165e12, 82.6e12, 1.0e12),
        ("V100", 125e12, 15.7e12, 0.9e12),
    )
)


def device_spec(device_name: Optional[str]) -> Optional[DeviceSpec]:
    """The data sheet of the device NVML or torch names (e.g. ``NVIDIA H100 80GB HBM3``), or None for one the table
    does not hold."""
    upper = (device_name or "").upper()
    return next((s for s in DEVICE_SPECS if s.key in upper), None) if upper else None


def peak_flops(device_name: Optional[str], dtype: str = "bfloat16") -> Optional[float]:
    """The device's dense peak for a compute dtype (None where unknown: MFU is then null)."""
    spec = device_spec(device_name)
    return spec.flops(dtype) if spec else None
