"""Log-probs and entropy of the response tokens, read from a micro-batch's logits with verl's GPU memory (torch).

verl 0.9.1 on a GPU keeps the LM head's output once, in the compute dtype, and reads it with flash-attn's Triton
cross-entropy (``utils/torch_functional.py:logprobs_from_logits``): each row is reduced in registers, only the
per-row results are written, and its backward writes the gradient into the logits themselves
(``inplace_backward``) unless the entropy reads them too. Its entropy is ``torch.compile``'d (fused, nothing of
``tokens x vocab`` written) or chunked (``entropy_from_logits_with_chunking``: one chunk's fp32 work at a time).

Here the same shape of memory without a custom kernel: the logits ``(M, V)`` are read by rows (``rows`` picks the
ones that predict a response token), a chunk of them at a time upcast to fp32 (:func:`chunk_rows` bounds a chunk
to a share of the logits), and autograd keeps only the logits and one value per row; the backward recomputes each
chunk's softmax and writes its gradient straight into its rows (into the logits when ``inplace_backward``).
Numbers and bytes: ``benchmarks/bench_pass_memory.py``; the same values as the plain formulas:
``tests/trainer/engine/test_logits.py``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["chunk_rows", "token_log_probs", "entropy_stats", "token_entropy"]

#: A chunk's fp32 work is at most this share of the logits it reads (bench_pass_memory: ours within 1.1x verl's)
_CHUNKS_PER_LOGITS = 64
#: ... and never smaller than this (a small batch or vocabulary runs in one chunk: fewer calls, no memory at stake)
_MIN_CHUNK_BYTES = 16 << 20


def chunk_rows(num_rows: int, vocab: int) -> int:
    """Rows of a ``num_rows x vocab`` logits tensor worked on at once: a 1/64 share of them, at least 16 MiB of
    fp32 (at least one row)."""
    return max(1, -(-num_rows // _CHUNKS_PER_LOGITS), _MIN_CHUNK_BYTES // (4 * max(vocab, 1)))


def _spans(n: int, step: int) -> list[tuple[int, int]]:
    """[start, stop) of ``n`` rows in chunks of ``step``; a last chunk of one row joins the one before (a compiled
    kernel would specialize on a size of 1 and recompile)."""
    spans = [(s, min(s + step, n)) for s in range(0, n, step)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] == 1:
        spans[-2:] = [(spans[-2][0], n)]
    return spans


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    # the reductions run in fp32 (fp64 stays fp64): bf16 loses several bits of a log-prob over a large vocabulary
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _rows(logits: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The chosen rows of ``logits`` as a fresh ``dtype`` tensor (one copy, the chunk's)."""
    return logits.index_select(0, rows).to(dtype)


def _log_sum_exp_(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp of ``x`` (c, V) -> (c,), overwriting ``x`` with ``exp(x - max)``: no second (c, V)
    tensor (torch.logsumexp makes one)."""
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # rows of -inf: as torch.logsumexp
    return x.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, labels, inplace_backward: bool):
        dtype = _work_dtype(logits)
        out = torch.empty(rows.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        for s, e in _spans(rows.shape[0], chunk_rows(logits.shape[0], logits.shape[-1])):
            x = _rows(logits, rows[s:e], dtype)
            picked = x.gather(-1, labels[s:e, None]).squeeze(-1)
            lse[s:e] = _log_sum_exp_(x)
            out[s:e] = picked - lse[s:e]
        ctx.save_for_backward(logits, rows, labels, lse)
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, rows, labels, lse = ctx.saved_tensors
        # d log p(y) / d x = onehot(y) - softmax(x), per row, times the row's incoming gradient
        grad = logits if ctx.inplace_backward else torch.zeros_like(logits)
        if ctx.inplace_backward:  # the rows no token reads get 0; the read ones are overwritten below
            read = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device).index_fill_(0, rows, True)
            grad.masked_fill_(~read[:, None], 0)
        for s, e in _spans(rows.shape[0], chunk_rows(logits.shape[0], logits.shape[-1])):
            g = grad_out[s:e, None]
            x = _rows(logits, rows[s:e], lse.dtype).sub_(lse[s:e, None]).exp_().mul_(-g)
            x.scatter_add_(-1, labels[s:e, None], g)
            grad.index_copy_(0, rows[s:e], x.to(grad.dtype))
        return grad, None, None, None


def token_log_probs(
    logits: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, *, inplace_backward: bool = False
) -> torch.Tensor:
    """``log softmax(logits[rows])[labels]``: ``logits`` (M, V) in any float dtype, ``rows`` (N,) distinct row
    indices, ``labels`` (N,) token ids -> (N,) fp32 (fp64 for fp64 logits).

    Autograd keeps ``logits`` (no copy) and one fp32 value per row. ``inplace_backward``: the gradient is written
    into ``logits`` (as flash-attn's cross-entropy does for verl); only when nothing else reads them in backward."""
    return _TokenLogProbs.apply(logits, rows, labels.long(), inplace_backward)


def entropy_stats(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (c, V), in fp32 (fp64 for fp64): ``(c, 2)`` = [log-sum-exp, entropy], with
    ``H = lse - sum(softmax(x) * x)`` (finite where probabilities underflow). Two (c, V) tensors at most: the fp32
    copy of ``x`` and ``exp(x - max)``, which then takes the product in place."""
    x = x.to(_work_dtype(x), copy=True)
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    e = (x - top).exp_()
    total = e.sum(dim=-1, keepdim=True)
    lse = total.log() + top
    mean_x = e.mul_(x).sum(dim=-1, keepdim=True) / total
    return torch.cat([lse, lse - mean_x], dim=-1)


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, step: int, stats: Callable[[torch.Tensor], torch.Tensor]):
        dtype = _work_dtype(logits)
        out = torch.empty(rows.shape[0], 2, dtype=dtype, device=logits.device)
        for s, e in _spans(rows.shape[0], step):
            out[s:e] = stats(logits.index_select(0, rows[s:e]))
        ctx.save_for_backward(logits, rows, out)
        ctx.step = step
        return out[:, 1].clone()

    @staticmethod
    def backward(ctx, grad_out):
        logits, rows, saved = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        # d H / d x = softmax(x) * (E - x), E = sum(softmax(x) * x) = lse - H
        for s, e in _spans(rows.shape[0], ctx.step):
            lse, entropy = saved[s:e, 0:1], saved[s:e, 1:2]
            x = _rows(logits, rows[s:e], saved.dtype)
            p = (x - lse).exp_()
            d = x.neg_().add_(lse - entropy).mul_(p).mul_(grad_out[s:e, None])
            grad.index_copy_(0, rows[s:e], d.to(grad.dtype))
        return grad, None, None, None


def token_entropy(
    logits: torch.Tensor,
    rows: torch.Tensor,
    *,
    chunk_size: Optional[int] = None,
    stats: Callable[[torch.Tensor], torch.Tensor] = entropy_stats,
) -> torch.Tensor:
    """Entropy of ``softmax(logits[rows])``: ``logits`` (M, V), ``rows`` (N,) distinct -> (N,) fp32, ``chunk_size``
    rows at a time (default :func:`chunk_rows`), each chunk through ``stats`` (:func:`entropy_stats`, or its
    compiled form). Autograd keeps ``logits`` and two values per row; the backward recomputes each chunk's softmax."""
    step = chunk_size or chunk_rows(logits.shape[0], logits.shape[-1])
    return _TokenEntropy.apply(logits, rows, step, stats)
