"""What a run with ``device: auto`` runs on: a GPU when NVML sees one, else the CPU (no torch: NVML only)."""

from __future__ import annotations

__all__ = ["detect_device"]


def detect_device(want: str) -> str:
    if want != "auto":
        return want
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return "cuda" if n > 0 else "cpu"
    except Exception:  # noqa: BLE001 - no driver, no library: a CPU machine
        return "cpu"
