"""A model's shape and its parameter counts, from the HF config fields alone (no weights, no torch).

A trial records its actor's shape (``TrialRecord.model_shape``: the fields of
``trainer.engine.roles.SHAPE_KEYS`` plus ``head_dim`` and ``num_params``); :func:`param_counts` splits it into
the pieces the memory terms need: the embedding, one decoder block (attention, MLP, norms), the final
norm, the LM head (absent when tied) and the critic's value head, and the FSDP units they form (each
decoder block is one unit; the root unit holds what is outside the blocks).

Dense decoder-only models (Qwen2/2.5, Qwen3, Llama, Mistral): q/k/v/o projections with grouped-query
attention, a gated (SwiGLU) MLP ``3·h·i``, two RMSNorms per block. Mixture-of-experts layers are not
modelled (their expert count is not among the recorded fields).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["ModelShape", "ParamCounts", "param_counts", "shape_of_config"]

#: model types whose q/k/v projections carry a bias (Qwen2's ``attention_bias`` is hard-wired to True)
_QKV_BIAS = ("qwen2",)
#: model types with an RMSNorm on each head's queries and keys (Qwen3's q_norm / k_norm)
_QK_NORM = ("qwen3",)


@dataclass(frozen=True)
class ModelShape:
    """The HF config fields of a decoder-only LM that its memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    model_type: str = ""
    num_params: Optional[int] = None  # as the trial counted it (a check on param_counts), if known

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelShape":
        """From a trial's ``model_shape`` (or an HF ``config.json``); ``head_dim`` defaults to hidden / heads,
        ``num_key_value_heads`` to the number of heads (multi-head attention)."""
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                tie_word_embeddings=bool(d.get("tie_word_embeddings") or False),
                model_type=str(d.get("model_type") or ""),
                num_params=int(d["num_params"]) if d.get("num_params") is not None else None,
            )
        except KeyError as e:
            raise ValueError(f"model shape: missing field {e.args[0]!r}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the pieces of a model (elements, not bytes)."""

    embedding: int
    attention_per_layer: int
    mlp_per_layer: int
    norms_per_layer: int
    num_layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding
    value_head: int  # the critic's score head (Linear(h, 1) with a bias)

    @property
    def block(self) -> int:
        """One decoder block: one FSDP unit."""
        return self.attention_per_layer + self.mlp_per_layer + self.norms_per_layer

    @property
    def actor(self) -> int:
        """The causal LM: actor and reference model."""
        return self.embedding + self.num_layers * self.block + self.final_norm + self.lm_head

    @property
    def critic(self) -> int:
        """The backbone with a value head instead of the LM head."""
        return self.embedding + self.num_layers * self.block + self.final_norm + self.value_head

    @property
    def actor_root(self) -> int:
        """The actor's root FSDP unit: everything outside the blocks (usually the largest unit)."""
        return self.embedding + self.final_norm + self.lm_head

    @property
    def critic_root(self) -> int:
        return self.embedding + self.final_norm + self.value_head


def param_counts(shape: ModelShape) -> ParamCounts:
    """Parameter counts from the config fields. Qwen2.5-0.5B (vocab 151936, hidden 896, intermediate 4864,
    24 layers, 14 heads, 2 KV heads, tied) gives 494,032,768, the checkpoint's count."""
    h, q, kv = shape.hidden_size, shape.q_dim, shape.kv_dim
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
    if shape.model_type in _QKV_BIAS:
        attention += q + 2 * kv
    norms = 2 * h  # input and post-attention RMSNorm
    if shape.model_type in _QK_NORM:
        norms += 2 * shape.head_dim
    embedding = shape.vocab_size * h
    return ParamCounts(
        embedding=embedding,
        attention_per_layer=attention,
        mlp_per_layer=3 * h * shape.intermediate_size,  # gate, up, down (SwiGLU)
        norms_per_layer=norms,
        num_layers=shape.num_hidden_layers,
        final_norm=h,
        lm_head=0 if shape.tie_word_embeddings else embedding,
        value_head=h + 1,
    )


def shape_of_config(flat: Mapping[str, Any], known: ModelShape) -> ModelShape:
    """The actor's shape for a config: ``known`` (what a trial of this study recorded), with the embedded
    tiny preset's fields (``ppotune.tiny.*``) applied when the config builds the tiny model, so a space that
    varies the preset's width predicts each candidate's own shape (the vocabulary is the tokenizer's: kept)."""
    if flat.get("actor_rollout_ref.model.path") != "tiny" or "ppotune.tiny.hidden_size" not in flat:
        return known
    hidden, heads = int(flat["ppotune.tiny.hidden_size"]), int(flat["ppotune.tiny.num_attention_heads"])
    return dataclasses.replace(
        known,
        hidden_size=hidden,
        intermediate_size=int(flat["ppotune.tiny.intermediate_size"]),
        num_hidden_layers=int(flat["ppotune.tiny.num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(flat["ppotune.tiny.num_key_value_heads"]),
        head_dim=hidden // heads,
        num_params=None,
    )
