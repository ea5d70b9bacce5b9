"""Attention for packed micro-batches with memory linear in tokens (verl's flash-attn varlen, without flash-attn).

With ``attn_implementation="sdpa"``, transformers turns a packed row (position ids restarting at 0
for each sequence, no attention mask) into a dense T x T block-diagonal mask: memory quadratic in
the packed token count, gigabytes at a 32k token budget. Here the packed call gets no mask at all;
the sequence boundaries travel as transformers' ``FlashAttentionKwargs`` (``cu_seq_lens_q`` ...)
through ``model(**packed_attention_kwargs(position_ids))`` down to every attention layer, which runs

* ``flash_attn_varlen_func`` when flash-attn is installed and the tensors are half precision on CUDA;
* else torch's own build of that kernel (``torch.nn.attention.varlen.varlen_attn``), half precision on CUDA;
* else, on CUDA, torch's flex attention over the whole row with a causal block-diagonal :class:`BlockMask` built
  from the host lengths (:func:`block_diagonal_mask`: the key blocks each block of queries reaches, never a
  T x T mask), compiled once per process: one fused call per layer in any precision, grouped kv heads as they are;
* otherwise (a CPU) one ``scaled_dot_product_attention(is_causal=True)`` per sequence, without a mask, which
  dispatches to a fused kernel: no L x L matrix is kept for backward.

Every call that carries a padding mask or a KV cache (HF ``generate``, the padded
``use_remove_padding=False`` path) is handed to transformers' own sdpa mask and attention unchanged.

Both hooks are transformers' public registries (``AttentionInterface``, ``AttentionMaskInterface``);
importing this module registers :data:`PACKED_ATTENTION`, a name to pass as ``attn_implementation``.
"""

from __future__ import annotations

import bisect
import importlib.util
import itertools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

__all__ = [
    "PACKED_ATTENTION",
    "packed_attention_kwargs",
    "varlen_kwargs",
    "packed_attention_forward",
    "packed_kernel",
    "block_diagonal_mask",
    "FLASH_VARLEN",
    "TORCH_VARLEN",
    "FLEX_BLOCK_DIAGONAL",
    "PER_SEQUENCE_SDPA",
]

PACKED_ATTENTION = "ppotune_packed"

# Host-side sequence lengths, next to transformers' varlen kwargs: the per-sequence sdpa loop slices
# with Python ints, and reading them from ``cu_seq_lens_q`` in every layer would sync the device
# once per layer instead of once per micro-batch.
_SEQ_LENS = "ppotune_seq_lens"
# A micro-batch's flex BlockMask, built by the first layer and read by the others (a dict shared by their kwargs)
_FLEX_MASKS = "ppotune_flex_masks"

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _torch_varlen():
    """torch's own varlen flash attention (``torch.nn.attention.varlen.varlen_attn``, CUDA, half precision) when
    this torch has it with grouped kv heads and causal windows; else None."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"enable_gqa", "window_size", "scale"} <= params.keys() else None


_TORCH_VARLEN = _torch_varlen()


def _flex_attention():
    """torch's flex attention (``torch.nn.attention.flex_attention``) when this torch has it; else None."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return flex_attention


_FLEX = _flex_attention()
_COMPILED_FLEX: dict[str, object] = {}

FLASH_VARLEN = "flash_attn_varlen"
TORCH_VARLEN = "torch_varlen"
FLEX_BLOCK_DIAGONAL = "flex_block_diagonal"
PER_SEQUENCE_SDPA = "sdpa_per_sequence"
#: flex attention's block of queries and of keys (its default)
_FLEX_BLOCK = 128


def packed_kernel(
    device_type: str,
    dtype: torch.dtype,
    *,
    has_flash: bool = _HAS_FLASH_ATTN,
    has_torch_varlen: bool = _TORCH_VARLEN is not None,
    has_flex: bool = _FLEX is not None,
) -> str:
    """The kernel a packed row's attention runs on ``device_type`` in ``dtype``: :data:`FLASH_VARLEN` (one call
    for the whole row: what verl runs) where flash-attn is installed and the compute is half precision on
    CUDA; else :data:`TORCH_VARLEN`, torch's own build of the same flash-attention varlen kernel, where torch has
    it (half precision on CUDA); else on CUDA :data:`FLEX_BLOCK_DIAGONAL` (torch's flex attention, one compiled
    call per row, any precision); else :data:`PER_SEQUENCE_SDPA` (one fused sdpa call per sequence: the same
    memory, more calls; a CPU's)."""
    if device_type != "cuda":
        return PER_SEQUENCE_SDPA
    if dtype in (torch.float16, torch.bfloat16):
        if has_flash:
            return FLASH_VARLEN
        if has_torch_varlen:
            return TORCH_VARLEN
    return FLEX_BLOCK_DIAGONAL if has_flex else PER_SEQUENCE_SDPA


def _sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids -> (B, L) bool, True where a sequence starts: at column 0 and wherever the
    position does not follow its predecessor by 1 (the rule transformers uses to find packed sequences,
    so both paths split a row the same way)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def _row_seq_lens(starts: torch.Tensor) -> list[tuple[int, ...]]:
    """(B, L) sequence starts -> the sequence lengths of each row, with one device-to-host copy."""
    width = starts.shape[1]
    rows: list[list[int]] = [[] for _ in range(starts.shape[0])]
    for b, t in starts.nonzero().tolist():
        rows[b].append(t)
    return [tuple(e - s for s, e in zip(r, r[1:] + [width])) for r in rows]


def packed_attention_kwargs(position_ids: torch.Tensor) -> dict:
    """Model-call kwargs that mark the sequences of one packed row, from its (1, T) position ids.

    Returns transformers' varlen kwargs ``cu_seq_lens_q/k`` (int32, (num_seqs + 1,), on the ids'
    device, as flash-attn wants them) and ``max_length_q/k``, plus the lengths as Python ints.
    """
    assert position_ids.dim() == 2 and position_ids.shape[0] == 1, "one packed row: (1, T) position ids"
    # A host sync: the per-sequence loop and flash-attn's max_seqlen need ints. The trainer knows the lengths
    # on the host already (trainer/engine/batching.py: build_layouts) and calls varlen_kwargs instead.
    (seq_lens,) = _row_seq_lens(_sequence_starts(position_ids))
    cu = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=position_ids.device)
    return varlen_kwargs(seq_lens, cu)


def varlen_kwargs(seq_lens: tuple[int, ...], cu_seq_lens: torch.Tensor) -> dict:
    """:func:`packed_attention_kwargs` from lengths already on the host and their (num_seqs + 1,) int32 running
    sums already on the device: no device read."""
    cu = cu_seq_lens
    longest = max(seq_lens)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        _SEQ_LENS: seq_lens,
        _FLEX_MASKS: {},
    }


def _packed_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """No mask for a self-contained causal call (no padding mask, no cached tokens); sdpa's mask otherwise.

    That call is the one transformers would turn into a T x T block-diagonal mask when the row is
    packed; its attention is fully given by the sequence boundaries, which the attention function
    reads from the varlen kwargs (or, failing those, from the position ids). Sliding-window and
    bidirectional masks keep sdpa's mask: the per-sequence kernels here are plain causal.
    """
    self_contained = (
        attention_mask is None
        and isinstance(q_offset, int)  # a tensor offset comes from a static cache
        and q_offset == 0
        and kv_offset == 0
        and q_length == kv_length
        and kwargs.get("local_size") is None
        and "allow_is_bidirectional_skip" not in kwargs  # passed only by create_bidirectional_mask
    )
    if self_contained:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def _per_sequence_sdpa(query, key, value, seq_lens, *, dropout: float, scaling, is_causal: bool) -> torch.Tensor:
    """(1, H, T, D) q and (1, H_kv, T, D) k/v -> (1, T, H, D): causal attention within each sequence.

    No mask is passed, so sdpa picks a fused kernel; the splits are views, the only copy is the
    output concatenation (T x H x D), so memory stays linear in T.
    """
    n_rep = query.shape[1] // key.shape[1]
    # Grouped kv heads: CPU's fused kernel takes them as they are (enable_gqa: see benchmarks/README.md);
    # elsewhere not every fused kernel does (CUDA's memory-efficient one, used for fp32), and a
    # fallback to the math kernel would keep L x L weights, so the kv heads are repeated (T x H x D).
    gqa = n_rep > 1 and query.device.type == "cpu"
    if n_rep > 1 and not gqa:
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    outs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=gqa)
        for q, k, v in zip(*(x.split(seq_lens, dim=2) for x in (query, key, value)))
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _flash_varlen(query, key, value, kwargs: dict, *, dropout: float, scaling, is_causal: bool) -> torch.Tensor:
    """flash-attn's varlen kernel on the packed row: (1, H, T, D) -> (1, T, H, D). GQA is native."""
    from flash_attn import flash_attn_varlen_func

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=kwargs["cu_seq_lens_q"],
        cu_seqlens_k=kwargs["cu_seq_lens_k"],
        max_seqlen_q=kwargs["max_length_q"],
        max_seqlen_k=kwargs["max_length_k"],
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=is_causal,
    )
    return out.unsqueeze(0)


def _torch_varlen_call(query, key, value, kwargs: dict, *, scaling, is_causal: bool) -> torch.Tensor:
    """torch's varlen flash attention on the packed row: (1, H, T, D) -> (1, T, H, D). GQA is native."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    out = _TORCH_VARLEN(
        q,
        k,
        v,
        kwargs["cu_seq_lens_q"],
        kwargs["cu_seq_lens_k"],
        kwargs["max_length_q"],
        kwargs["max_length_k"],
        scale=scaling,
        window_size=(-1, 0) if is_causal else (-1, -1),
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.unsqueeze(0)


def block_diagonal_mask(seq_lens: tuple[int, ...], cu_seq_lens: torch.Tensor):
    """Flex attention's :class:`BlockMask` of one packed row: causal within each sequence of ``seq_lens`` (host
    ints; ``cu_seq_lens`` their (num_seqs + 1,) running sums on the device), nothing across sequences.

    Built from the lengths on the host, block by block (:data:`_FLEX_BLOCK` tokens): each block of queries lists
    the key blocks from the start of its first sequence up to itself; a key block is *full* (no mask evaluated)
    when it and the query block lie in one sequence and it comes first, else *partial* (the mask function decides
    per token). No T x T mask is made; the index tensors are (T / 128)^2 at most, moved to the device at once."""
    from torch.nn.attention.flex_attention import BlockMask

    total, block = sum(seq_lens), _FLEX_BLOCK
    starts = list(itertools.accumulate((0,) + tuple(seq_lens[:-1])))

    def seq_of(token: int) -> int:
        return bisect.bisect_right(starts, token) - 1

    partial: list[list[int]] = []
    full: list[list[int]] = []
    for qb in range(-(-total // block)):
        last = min((qb + 1) * block, total) - 1
        first_key_block = starts[seq_of(qb * block)] // block
        whole = [kb for kb in range(first_key_block, qb) if seq_of(kb * block) == seq_of(last)]
        full.append(whole)
        partial.append([kb for kb in range(first_key_block, qb + 1) if kb not in whole])
    device = cu_seq_lens.device

    def packed(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, 1, blocks) counts and (1, 1, blocks, blocks) indices (flex reads the key blocks' number from the
        last dimension), padded with 0 (not read past the count)."""
        width = len(lists)
        idx = torch.tensor([x + [0] * (width - len(x)) for x in lists], dtype=torch.int32)
        counts = torch.tensor([len(x) for x in lists], dtype=torch.int32)
        return counts.to(device)[None, None], idx.to(device)[None, None]

    seq_id = torch.bucketize(torch.arange(total, device=device), cu_seq_lens[1:].to(torch.int64), right=True)

    def causal_within_sequences(b, h, q, kv):
        return (seq_id[q] == seq_id[kv]) & (q >= kv)

    kv_num, kv_idx = packed(partial)
    full_num, full_idx = packed(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=causal_within_sequences,
        seq_lengths=(total, total),
    )


def _flex_call(query, key, value, kwargs: dict, *, scaling, compiled: bool) -> torch.Tensor:
    """Flex attention over the packed row with its block-diagonal causal mask: (1, H, T, D) -> (1, T, H, D). GQA is
    native; on CUDA the call is compiled (one fused kernel; eager flex would keep the T x T scores)."""
    masks = kwargs.get(_FLEX_MASKS)
    mask = masks.get("mask") if masks is not None else None
    if mask is None:
        seq_lens = kwargs.get(_SEQ_LENS) or tuple(kwargs["cu_seq_lens_q"].diff().tolist())
        mask = block_diagonal_mask(seq_lens, kwargs["cu_seq_lens_q"])
        if masks is not None:
            masks["mask"] = mask
    fn = _FLEX
    if compiled:
        if "flex" not in _COMPILED_FLEX:
            # one graph for every token count; CUDA only (a CPU run never takes this path: inductor's CPU flex
            # template compiles a first shape but fails on dynamic ones in torch 2.13)
            _COMPILED_FLEX["flex"] = torch.compile(_FLEX, dynamic=True)
        fn = _COMPILED_FLEX["flex"]
    gqa = query.shape[1] != key.shape[1]
    out = fn(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, q, D) q and (B, H_kv, kv, D) k/v -> ((B, q, H, D), None)."""
    q_length = query.shape[2]
    if attention_mask is not None or q_length != key.shape[2] or q_length == 1:
        # padded rows, generation with a cache, decoding: exactly what "sdpa" does
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"{PACKED_ATTENTION} attention supports neither softcap nor position_bias; use 'sdpa'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window")
    if kwargs.get("cu_seq_lens_q") is not None:
        assert query.shape[0] == 1, "the varlen kwargs describe one packed row"
        seq_lens = kwargs.get(_SEQ_LENS) or tuple(kwargs["cu_seq_lens_q"].diff().tolist())
        assert sum(seq_lens) == q_length, "the varlen kwargs do not match the packed row"
        if window is not None and max(seq_lens) > window:
            raise ValueError(f"{PACKED_ATTENTION}: a packed sequence is longer than the sliding window {window}")
        kernel = packed_kernel(query.device.type, query.dtype)
        if kernel == FLASH_VARLEN:
            return _flash_varlen(query, key, value, kwargs, dropout=dropout, scaling=scaling, is_causal=is_causal), None
        if kernel == TORCH_VARLEN and not dropout:
            return _torch_varlen_call(query, key, value, kwargs, scaling=scaling, is_causal=is_causal), None
        if kernel == FLEX_BLOCK_DIAGONAL and not dropout and is_causal:
            return _flex_call(query, key, value, kwargs, scaling=scaling, compiled=query.is_cuda), None
        out = _per_sequence_sdpa(query, key, value, seq_lens, dropout=dropout, scaling=scaling, is_causal=is_causal)
        return out, None
    # No varlen kwargs and no mask: the mask hook dropped the mask, so the position ids are the only
    # record of packed sequences. Reading them costs a device sync in every layer, which is why the
    # trainer passes packed_attention_kwargs instead.
    position_ids = kwargs.get("position_ids")
    rows = None
    if position_ids is not None:
        rows = _row_seq_lens(_sequence_starts(position_ids.expand(query.shape[0], -1)))
    if rows is None or all(len(r) == 1 for r in rows):
        return sdpa_attention_forward(
            module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if window is not None and max(max(r) for r in rows) > window:
        raise ValueError(f"{PACKED_ATTENTION}: a packed sequence is longer than the sliding window {window}")
    outs = [
        _per_sequence_sdpa(
            query[b : b + 1], key[b : b + 1], value[b : b + 1], r, dropout=dropout, scaling=scaling, is_causal=is_causal
        )
        for b, r in enumerate(rows)
    ]
    return torch.cat(outs, dim=0), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)
