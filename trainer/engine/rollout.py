"""Rollout: which engine a run's rollout is (:func:`with_rollout`), and sampling responses with HF ``generate`` from
the actor's current (sharded) weights.

With more than one rank every rank decodes until all ranks are done (``synced_gpus=True``): a rank that stops
early keeps joining the collectives of the others, so ranks generating different lengths never deadlock. One
rank has no one to wait for: ``synced_gpus`` would only add an all-reduce and a host read per decoded token.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.config import rollout_name
from trainer.engine.parallel import Sharded, full_params

__all__ = ["Sampling", "with_rollout", "generate_responses", "response_mask_from_eos"]


def with_rollout(cfg, device_type: str):
    """``cfg`` with ``actor_rollout_ref.rollout.name`` set to the rollout this run uses on ``device_type``
    (:func:`trainer.config.rollout_name`: vLLM on a GPU when the config names none; ``ppotune train`` refused
    before its ranks started where vLLM does not import)."""
    ro = cfg.actor_rollout_ref.rollout
    vllm = importlib.util.find_spec("vllm") is not None
    name = rollout_name(ro.name, device_type=device_type, vllm_importable=vllm)
    if name == ro.name:
        return cfg
    arr = dataclasses.replace(cfg.actor_rollout_ref, rollout=dataclasses.replace(ro, name=name))
    return dataclasses.replace(cfg, actor_rollout_ref=arr)


@dataclass(frozen=True)
class Sampling:
    """How responses are sampled: the rollout settings both engines (HF generate, vLLM) take."""

    max_response_length: int
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool
    ignore_eos: bool  # EOS cannot be sampled before max_response_length (every response is full length)
    pad_id: int
    eos_id: int
    vocab_limit: int  # ids at or past it decode to nothing (an embedding padded past the tokenizer)


def response_mask_from_eos(responses: torch.Tensor, eos_id: int, generated: int) -> torch.Tensor:
    """(B, R) -> (B, R) long mask: 1 up to and including the first EOS, and only where a token was generated.

    Built from EOS alone, never from the pad id: a sampled pad token mid-response is a real token.
    """
    is_eos = (responses == eos_id).long()
    before_or_at_eos = (torch.cumsum(is_eos, dim=1) - is_eos) == 0
    in_range = torch.arange(responses.shape[1], device=responses.device) < generated
    return (before_or_at_eos & in_range).long()


@torch.no_grad()
def generate_responses(
    actor: Sharded,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: Sampling,
    *,
    streamer=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (B, P) -> responses (B, R) right-padded with ``pad_id``, response_mask (B, R);
    ``streamer``: HF generate's, told the prompt and each decode step."""
    R, pad_id, eos_id = sampling.max_response_length, sampling.pad_id, sampling.eos_id
    sample = sampling.do_sample and sampling.temperature > 0
    kwargs = dict(
        max_new_tokens=R,
        do_sample=sample,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
        use_cache=True,
    )
    if sampling.ignore_eos:
        kwargs["min_new_tokens"] = R
    if streamer is not None:
        kwargs["streamer"] = streamer
    if sample:
        kwargs.update(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k if sampling.top_k > 0 else 0
        )
    with full_params(actor) as module:
        was_training = module.training
        module.eval()  # no gradient checkpointing (which would disable the KV cache) while decoding
        try:
            # The embedding may be padded past the tokenizer: never sample ids that decode to nothing.
            vocab = module.config.vocab_size
            bad = [[i] for i in range(sampling.vocab_limit, vocab)]
            if bad:
                kwargs["bad_words_ids"] = bad
            out = module.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
        finally:
            module.train(was_training)
    P = prompt_ids.shape[1]
    generated = out.shape[1] - P
    responses = torch.full((out.shape[0], R), pad_id, dtype=torch.long, device=out.device)
    responses[:, :generated] = out[:, P:]
    mask = response_mask_from_eos(responses, eos_id, generated)
    responses = torch.where(mask.bool(), responses, torch.full_like(responses, pad_id))
    return responses, mask
