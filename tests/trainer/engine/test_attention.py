"""Packed attention (trainer/engine/attention.py): exact, linear in tokens, and sdpa wherever a mask is given.

Real tiny Qwen2 models on CPU, fp32. The reference is transformers' own "sdpa" on the same
weights: each sequence run on its own, and the packed row with its dense block mask (the old path).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from support import REPO
from trainer.config import TinyModelConfig
from trainer.engine.attention import PACKED_ATTENTION, packed_attention_kwargs
from trainer.engine.models import build_tokenizer, load_actor, load_critic

LENGTHS = [7, 33, 1, 64, 20]  # a single-token sequence included


def _models(kind: str):
    """(packed model, sdpa model) with the same weights."""
    load = load_actor if kind == "actor" else load_critic
    new = load("tiny", build_tokenizer(), tiny=TinyModelConfig(), max_positions=128)
    assert new.config._attn_implementation == PACKED_ATTENTION
    old = copy.deepcopy(new)
    old.set_attn_implementation("sdpa")
    return new, old


def _packed_row(lengths: list[int], vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, pos


def _logits_and_grads(model, calls, weight):
    """Per-token outputs of ``calls`` (kwargs of model calls, concatenated along tokens) and the
    parameter gradients of a fixed random linear functional of them."""
    model.zero_grad(set_to_none=True)
    out = torch.cat([model(use_cache=False, **kw).logits for kw in calls], dim=1)
    (out * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _assert_close(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        # fp32 sums in another order: differences of a few ulps of the tensor's largest entry
        scale = grads_b[name].abs().max().item()
        torch.testing.assert_close(g, grads_b[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_kwargs_mark_each_sequence():
    _, pos = _packed_row(LENGTHS, 16)
    kw = packed_attention_kwargs(pos)
    expected = torch.tensor([0, 7, 40, 41, 105, 125], dtype=torch.int32)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert kw[key].dtype == torch.int32 and kw[key].device == pos.device
        assert torch.equal(kw[key], expected)
    assert kw["max_length_q"] == kw["max_length_k"] == 64
    # one sequence: a single segment
    assert packed_attention_kwargs(torch.arange(5).unsqueeze(0))["cu_seq_lens_q"].tolist() == [0, 5]


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_packed_equals_each_sequence_alone_and_the_dense_mask(kind):
    new, old = _models(kind)
    ids, pos = _packed_row(LENGTHS, new.config.vocab_size)
    weight = torch.randn(1, ids.shape[1], new.config.num_labels if kind == "critic" else new.config.vocab_size)

    packed = _logits_and_grads(new, [dict(input_ids=ids, position_ids=pos, **packed_attention_kwargs(pos))], weight)
    alone = _logits_and_grads(
        old,
        [
            dict(input_ids=seq_ids, position_ids=torch.arange(n).unsqueeze(0))
            for seq_ids, n in zip(ids.split(LENGTHS, dim=1), LENGTHS)
        ],
        weight,
    )
    dense_mask = _logits_and_grads(old, [dict(input_ids=ids, position_ids=pos)], weight)
    _assert_close(packed, alone)
    _assert_close(packed, dense_mask)
    # a packed call without the kwargs still finds the sequences (from the position ids)
    _assert_close(_logits_and_grads(new, [dict(input_ids=ids, position_ids=pos)], weight), packed)


def test_padded_rows_are_sdpa_unchanged():
    """The use_remove_padding=False path: left-padded rows with an attention mask go to sdpa as before."""
    new, old = _models("actor")
    ids = torch.randint(8, new.config.vocab_size, (3, 24))
    attn = torch.ones_like(ids)
    attn[0, :5] = 0
    attn[2, :11] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = new(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        b = old(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    assert torch.equal(a, b)


PROMPTS = {"left_padded": ["1+2=", "12+34+5=", "7="], "equal_lengths": ["1+2=", "3+4=", "5+6="]}


@pytest.mark.parametrize("prompts", PROMPTS.values(), ids=PROMPTS.keys())
def test_generate_matches_sdpa(prompts):
    tok = build_tokenizer()
    new, old = _models("actor")
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        a = new.generate(**enc, **kw)
        b = old.generate(**enc, **kw)
    assert a.shape[1] > enc["input_ids"].shape[1]
    assert torch.equal(a, b)


def _bench():
    """benchmarks/bench_attention.py, whose worker measures one forward+backward in a fresh process."""
    spec = importlib.util.spec_from_file_location("bench_attention", REPO / "benchmarks" / "bench_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_peak_memory_grows_linearly_with_packed_tokens():
    """The issue's acceptance: 4x the tokens in a packed micro-batch costs well under 16x the memory.

    Sequences of 512 tokens, 2k vs 8k tokens per micro-batch, an attention-dominated shape (hidden 32,
    2 layers). The old path (sdpa's dense T x T block mask) is measured too, to show the measurement
    sees a quadratic when there is one (benchmarks/README.md, "Packed attention").
    """
    bench = _bench()
    shape = ("--hidden", "32", "--heads", "2", "--kv-heads", "1", "--layers", "2")
    peak = {
        (path, tokens): bench.measure(path, tokens, seq_len=512, iters=0, extra=shape)["peak_mb"]
        for tokens in (2048, 8192)
        for path in ("old", "new")
    }
    new_ratio = peak["new", 8192] / peak["new", 2048]
    old_ratio = peak["old", 8192] / peak["old", 2048]
    print(f"peak MB {peak}; 4x tokens -> new x{new_ratio:.2f}, old (dense mask) x{old_ratio:.2f}")
    assert new_ratio < 6
    assert old_ratio > 8


def test_the_kernel_and_the_note_say_when_packed_attention_is_not_verls():
    """A varlen kernel (flash-attn's, else torch's own build of it) only on CUDA, in half precision; else on CUDA
    torch's flex attention over the row (fp32, or no varlen kernel), one sdpa call per sequence only where torch has
    no flex attention; a GPU run says when it did not run verl's kernel, and a CPU run says nothing (verl runs
    padded there)."""
    from trainer.config import effective_config, load_config
    from trainer.engine.attention import (
        FLASH_VARLEN,
        FLEX_BLOCK_DIAGONAL,
        PER_SEQUENCE_SDPA,
        TORCH_VARLEN,
        packed_kernel,
    )
    from trainer.engine.knob_notes import packed_attention_notes

    assert packed_kernel("cuda", torch.bfloat16, has_flash=True) == FLASH_VARLEN
    assert packed_kernel("cuda", torch.float16, has_flash=True) == FLASH_VARLEN
    # without flash-attn, torch's own build of the varlen kernel where this torch has it: one call per row too
    assert packed_kernel("cuda", torch.bfloat16, has_flash=False, has_torch_varlen=True) == TORCH_VARLEN
    # fp32, or no varlen kernel: flex attention, one call per row too
    for dtype, flash, varlen in ((torch.float32, True, True), (torch.bfloat16, False, False)):
        assert (
            packed_kernel("cuda", dtype, has_flash=flash, has_torch_varlen=varlen, has_flex=True) == FLEX_BLOCK_DIAGONAL
        )
        assert (
            packed_kernel("cuda", dtype, has_flash=flash, has_torch_varlen=varlen, has_flex=False) == PER_SEQUENCE_SDPA
        )
    assert (
        packed_kernel("cpu", torch.bfloat16, has_flash=True, has_torch_varlen=True, has_flex=True) == PER_SEQUENCE_SDPA
    )

    def cfg(over: dict):
        return effective_config(load_config(REPO / "configs" / "tiny_cpu.yaml", over))

    packed = {"actor_rollout_ref.model.use_remove_padding": True, "critic.model.use_remove_padding": True}
    bf16 = {f"{s}.mixed_precision.param_dtype": "bf16" for s in ("actor_rollout_ref.actor.fsdp_config", "critic.fsdp")}
    on = cfg(packed)
    assert packed_attention_notes(on, "cpu", has_flash=False) == []
    assert packed_attention_notes(cfg({**packed, **bf16}), "cuda", has_flash=True) == []
    fp32 = packed_attention_notes(on, "cuda", has_flash=True, has_flex=True)
    assert [n.split(":")[0] for n in fp32] == list(packed)
    assert all("fp32 compute" in n and "flex attention" in n for n in fp32)
    no_flex = packed_attention_notes(on, "cuda", has_flash=True, has_flex=False)
    assert all("one sdpa call per sequence" in n for n in no_flex) and len(no_flex) == 2
    missing = packed_attention_notes(cfg({**packed, **bf16}), "cuda", has_flash=False, has_torch_varlen=False)
    assert len(missing) == 2 and all("no flash-attn" in n for n in missing)
    assert packed_attention_notes(cfg({**packed, **bf16}), "cuda", has_flash=False, has_torch_varlen=True) == []
    off = cfg({k: False for k in packed})
    assert packed_attention_notes(off, "cuda", has_flash=False) == []


@pytest.mark.parametrize("lengths", [LENGTHS, [300], [130, 5, 200, 1, 129], [128, 128, 256]])
def test_flex_block_diagonal_equals_each_sequence_alone(lengths):
    """CUDA's path without flash-attn (one flex attention call over the row, grouped kv heads as they are) gives
    each sequence's own causal attention, against one sdpa call per sequence (eager flex on a CPU: the mask and the
    call CUDA compiles; flex has no backward on a CPU, so the gradients are the GPU check's). Lengths across flex's
    128-token blocks included."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from trainer.engine.attention import block_diagonal_mask

    g = torch.Generator().manual_seed(0)
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 16
    q, k, v = (torch.randn(1, h, total, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = block_diagonal_mask(tuple(lengths), cu)
    assert mask.kv_indices.shape[-2:] == (-(-total // 128),) * 2  # block indices, never a T x T mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex says it is not fused: here it checks the mask
        flex = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    alone = torch.cat(
        [
            F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
            for a, b, c in zip(*(x.split(lengths, dim=2) for x in (q, k, v)))
        ],
        dim=2,
    )
    torch.testing.assert_close(flex, alone, rtol=1e-5, atol=1e-5)
