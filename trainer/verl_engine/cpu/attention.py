"""Without flash-attn, a ``flash_attention_*`` request (verl hard-codes it for the critic) runs ``eager``."""

from __future__ import annotations

import functools
import importlib.util


def patch_attention() -> None:
    if importlib.util.find_spec("flash_attn") is not None:
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_ppotune_cpu", False):
        return

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
        if requested_attention is not None and "flash_attention" in requested_attention:
            requested_attention = "eager"
        return original(self, requested_attention, is_init_check)

    get_correct_attn_implementation._ppotune_cpu = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation
