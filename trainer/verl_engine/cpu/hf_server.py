"""The heavy half of :mod:`trainer.verl_engine.cpu.hf_rollout` (imported only when verl asks for it)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Optional

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

logger = logging.getLogger(__name__)


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"ppotune_hf_rollout_{replica_rank}{suffix}"


class HFServer:
    """Token-in, token-out generation with a HF causal LM on the CPU."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int):
        from transformers import AutoModelForCausalLM

        self.config = config
        path = getattr(model_config, "local_path", None) or model_config.path
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.global_steps: Optional[int] = None
        self.replica_rank = replica_rank
        self._lock = asyncio.Lock()

    # ---- generation
    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs: Any
    ) -> TokenOutput:
        params = dict(sampling_params)
        limit = self.config.prompt_length + self.config.response_length - len(prompt_ids)
        max_tokens = params.pop("max_tokens", None) or params.pop("max_new_tokens", None) or self.config.response_length
        max_tokens = max(1, min(int(max_tokens), self.config.response_length, limit))
        async with self._lock:  # one request at a time: the model is not re-entrant
            tokens, log_probs = await asyncio.to_thread(self._generate, list(prompt_ids), params, max_tokens)
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], params: dict[str, Any], max_tokens: int):
        temperature = float(params.get("temperature") or 0.0)
        top_p = float(params.get("top_p") or 1.0)
        top_k = int(params.get("top_k") or -1)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        sample = temperature > 0
        # rollout.ignore_eos (vLLM's SamplingParams.ignore_eos; the worst-case probe): every response max_tokens long
        ignore_eos = bool(params.get("ignore_eos", getattr(self.config, "ignore_eos", False)))
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens if ignore_eos else None,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=top_p if sample else None,
            top_k=top_k if sample and top_k > 0 else None,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids) or None,
            return_dict_in_generate=True,
            output_logits=True,
        )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        for i, t in enumerate(tokens):  # generate pads after EOS in a batch; keep up to and with the EOS
            if t in self.eos_ids and not ignore_eos:
                tokens = tokens[: i + 1]
                break
        log_probs = None
        if params.get("logprobs"):
            # the sampling distribution the actor recomputes: logits / temperature
            logits = torch.stack(out.logits[: len(tokens)], dim=1)[0].float() / (temperature if sample else 1.0)
            log_probs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        return tokens, log_probs

    # ---- weights
    def update_weights(self, state: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> int:
        own = self.model.state_dict()
        loaded = 0
        for name, tensor in state.items():
            if name in own:
                own[name].copy_(tensor.to(own[name].dtype))
                loaded += 1
        if loaded == 0:
            raise RuntimeError(f"hf rollout: none of the {len(state)} pushed tensors matched the model's names")
        self.global_steps = global_steps
        return loaded

    # ---- what verl's replica calls on its servers; nothing to free on the CPU
    async def wake_up(self, *a, **k):
        return None  # noqa: E704

    async def sleep(self, *a, **k):
        return None  # noqa: E704

    async def clear_kv_cache(self, *a, **k):
        return None  # noqa: E704

    async def release_kv_cache(self, *a, **k):
        return None  # noqa: E704

    async def resume_kv_cache(self, *a, **k):
        return None  # noqa: E704

    async def abort_all_requests(self, *a, **k):
        return {"aborted_count": 0, "request_ids": []}  # noqa: E704

    async def resume_generation(self, *a, **k):
        return None  # noqa: E704

    async def wait_for_requests_to_drain(self, *a, **k):
        return None  # noqa: E704

    async def start_profile(self, *a, **k):
        return None  # noqa: E704

    async def stop_profile(self, *a, **k):
        return None  # noqa: E704

    def get_server_address(self) -> tuple[str, int]:
        return "127.0.0.1", 0


class HFReplica(RolloutReplica):
    """One :class:`HFServer` per replica; it needs no accelerator."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        server = (
            ray.remote(HFServer)
            .options(
                name=server_name(self.replica_rank, self.name_suffix),
                num_cpus=0,
                max_concurrency=self.max_concurrency,
            )
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = "127.0.0.1:0"


class HFServerAdapter(BaseRollout):
    """In each trainer rank: pushes the actor's weights to its replica's server after every step."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // size if replica_rank == -1 else replica_rank
        self._has_server = rank % size == 0
        self._server = None

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        # every rank walks the generator: producing full tensors from FSDP shards is a collective
        state = {}
        for name, tensor in weights:
            if self._has_server:
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                state[name] = full.detach().to("cpu", copy=True)
        if self._has_server:
            if self._server is None:
                self._server = ray.get_actor(server_name(self.replica_rank))
            await self._server.update_weights.remote(state, global_steps=kwargs.get("global_steps"))
