"""A rank's failure is classified with the one memory table (trainer.contracts.MEMORY_MESSAGES) the verl adapter
reads verl's log with: an OOM exits 3 and says ``oom``; a vLLM share too small for one sequence is the opposite bound,
a config refusal the fit reads back, never an OOM. The exceptions carry the upstream text (file and function named)."""

import json
import subprocess
import sys
import textwrap

import pytest

from trainer.contracts import VLLM_UTILIZATION_KEY, ExitCode, MemoryOutcome, memory_message
from trainer.rank.process import is_oom_error

# vllm 0.33 v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory, raised in-process by the rank's engine
KV_TOO_SMALL = (
    "To serve at least one request with the model's max seq len (96), (0.01 GiB KV cache is needed, which is larger "
    "than the available KV cache memory (0.0 GiB). Try increasing `gpu_memory_utilization` (which also controls CPU "
    "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine."
)


@pytest.mark.parametrize(
    "exc, oom",
    [
        # NCCL src/include/alloc.h::ncclCallocDebug (ncclSystemError): host memory for NCCL's own structures
        (RuntimeError("NCCL error: ncclSystemError. Last error: Failed to malloc 1048576 bytes"), True),
        # ray's raylet memory monitor, surfacing in a rank's exception
        (RuntimeError("1 worker(s) were killed due to the node running low on memory."), True),
        # vllm/v1/worker/utils.py::request_memory: the trainer holds too much for the engine's share
        (
            ValueError(
                "Free memory on device cuda:0 (10/80 GiB) on startup is less than desired GPU memory utilization"
            ),
            True,
        ),
        (type("MyMemoryError", (MemoryError,), {})("arena exhausted"), True),  # any MemoryError
        (ValueError(KV_TOO_SMALL), False),  # the opposite bound
        (ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"), False),
        (ValueError("bad config"), False),
    ],
)
def test_is_oom_error_reads_the_table(exc, oom):
    assert is_oom_error(exc) is oom


_FAIL = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from trainer.rank.process import fail_rank, new_state

    fail_rank(ValueError(sys.argv[2]), 0, Path(sys.argv[1]), new_state())
    """
)


def _fail(tmp_path, message: str):
    r = subprocess.run(
        [sys.executable, "-c", _FAIL, str(tmp_path / "rank0.json"), message], capture_output=True, text=True, timeout=60
    )
    return r, json.loads((tmp_path / "rank0.json").read_text())


def test_a_vllm_share_too_small_for_one_sequence_is_a_config_refusal_not_an_oom(tmp_path):
    r, got = _fail(tmp_path, KV_TOO_SMALL)
    assert r.returncode == ExitCode.ERROR, r.stderr
    assert got["status"] == "error"
    assert got["error"].startswith(f"config: {VLLM_UTILIZATION_KEY} too small"), got["error"]
    assert memory_message(got["error"]).outcome is MemoryOutcome.UNDERSIZED  # what the fit reads back


def test_a_vllm_engine_that_cannot_get_its_share_is_an_oom(tmp_path):
    message = (
        "Free memory on device cuda:0 (10.0/79.19 GiB) on startup is less than desired GPU memory utilization "
        "(0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )
    r, got = _fail(tmp_path, message)
    assert r.returncode == ExitCode.OOM, r.stderr
    assert got["status"] == "oom" and got["error"] == f"ValueError: {message}"
