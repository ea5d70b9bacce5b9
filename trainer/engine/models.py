"""Actor, reference and critic models: from a local HF checkpoint or the embedded tiny preset.

Never a hub download: every load passes ``local_files_only=True`` and the tiny preset is
built from a config in code with a character-level tokenizer made on the spot.
"""

from __future__ import annotations

import string

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from trainer.engine.attention import PACKED_ATTENTION  # importing it registers the implementation

__all__ = ["build_tokenizer", "load_tokenizer", "load_actor", "load_critic", "tiny_qwen2_config", "num_params"]

TINY = "tiny"
_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII: offline, deterministic, tiny vocab. ``vocab_size``: the
    vocabulary filled up to that size with tokens no text encodes to (``<|x123|>``), for a model whose
    vocabulary is a real one's (a sampled id then always decodes)."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(_SPECIALS + chars)}
    vocab.update({f"<|x{i}|>": i for i in range(len(vocab), vocab_size or 0)})
    # BPE with no merges splits text into single characters; Fuse joins them back on decode.
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    core.add_special_tokens(_SPECIALS)
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = _CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    if path == TINY:
        return build_tokenizer()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def tiny_qwen2_config(tiny, vocab_size: int, max_positions: int) -> Qwen2Config:
    """The embedded model's shape, from ``ppotune.tiny`` (hidden size, layers, heads)."""
    return Qwen2Config(
        vocab_size=((vocab_size + 7) // 8) * 8,  # a multiple of 8, like real checkpoints
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=max(max_positions, 128),
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
    )


def _finish(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(torch.float32)


def load_actor(
    path: str, tokenizer, *, tiny=None, max_positions: int = 512, seed: int = 1, meta: bool = False
) -> torch.nn.Module:
    """Causal LM in fp32 (master weights). The tiny preset is seeded: every rank builds the same weights.

    ``meta``: the architecture only, on the meta device (no memory): ranks other than 0 build this and
    receive their shards from rank 0 when the model is sharded.
    """
    if meta:
        with torch.device("meta"):
            if path == TINY:
                return load_actor(TINY, tokenizer, tiny=tiny, max_positions=max_positions, seed=seed)
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
            return _finish(AutoModelForCausalLM.from_config(cfg, attn_implementation=PACKED_ATTENTION), tokenizer)
    if path == TINY:
        torch.manual_seed(seed)
        cfg = tiny_qwen2_config(tiny, len(tokenizer), max_positions)
        cfg._attn_implementation = PACKED_ATTENTION
        model = Qwen2ForCausalLM(cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation=PACKED_ATTENTION
        )
    return _finish(model, tokenizer)


def load_critic(
    path: str, tokenizer, *, tiny=None, max_positions: int = 512, seed: int = 1, meta: bool = False
) -> torch.nn.Module:
    """LM backbone + scalar value head (token classification with one label), verl's critic shape.

    From the tiny preset the backbone equals the actor's initial backbone; the head is seeded.
    ``meta``: as for :func:`load_actor`.
    """
    if meta:
        with torch.device("meta"):
            if path == TINY:
                return load_critic(TINY, tokenizer, tiny=tiny, max_positions=max_positions, seed=seed)
            cfg = _critic_config(AutoConfig.from_pretrained(path, local_files_only=True))
            return _finish(
                AutoModelForTokenClassification.from_config(cfg, attn_implementation=PACKED_ATTENTION), tokenizer
            )
    if path == TINY:
        actor = load_actor(TINY, tokenizer, tiny=tiny, max_positions=max_positions, seed=seed)
        cfg = Qwen2Config(
            **{
                **actor.config.to_dict(),
                "num_labels": 1,
                "id2label": {0: "value"},
                "label2id": {"value": 0},
                "classifier_dropout": 0.0,
            }
        )  # dropout would make old values and updates disagree
        cfg._attn_implementation = PACKED_ATTENTION
        torch.manual_seed(seed + 1)
        model = Qwen2ForTokenClassification(cfg)
        model.model.load_state_dict(actor.model.state_dict())
    else:
        cfg = _critic_config(AutoConfig.from_pretrained(path, local_files_only=True))
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=cfg, local_files_only=True, dtype=torch.float32, attn_implementation=PACKED_ATTENTION
        )
    return _finish(model, tokenizer)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _critic_config(cfg):
    """An LM config as verl's critic: one label (the value), no dropout (old values and updates must agree)."""
    cfg.num_labels = 1
    cfg.id2label = {0: "value"}
    cfg.label2id = {"value": 0}
    cfg.classifier_dropout = 0.0
    return cfg
