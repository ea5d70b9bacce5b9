"""The logits side of a step, as verl does it (trainer/engine/logits.py): log-probs and entropy equal to the plain
formulas, entropy only where it is needed, chunked and checkpointed variants equal to the plain one, and what each
keeps for backward measured in bytes."""

import pytest
import torch

from trainer.config import TinyModelConfig
from trainer.engine import core, logits
from trainer.engine.models import build_tokenizer, load_actor
from trainer.engine.parallelize import make_entropy_fn
from trainer.engine.step import assemble_batch, forward_response

P, R, B = 24, 16, 6


@pytest.fixture(scope="module")
def model_and_batch():
    tok = build_tokenizer()
    model = load_actor("tiny", tok, tiny=TinyModelConfig(), max_positions=P + R)
    g = torch.Generator().manual_seed(0)
    plen = torch.randint(4, P + 1, (B,), generator=g)
    rlen = torch.randint(1, R + 1, (B,), generator=g)
    pmask = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    rmask = (torch.arange(R)[None] < rlen[:, None]).long()
    ids = torch.randint(5, len(tok), (B, P), generator=g) * pmask
    resp = torch.randint(5, len(tok), (B, R), generator=g) * rmask
    return model, assemble_batch(ids, pmask, resp, rmask)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while ``fn`` runs (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_token_log_probs_equal_the_plain_formula_values_and_gradients(dtype, inplace):
    """The chunked, in-place-backward log-probs give the plain ``gather - logsumexp`` of the chosen rows, upcast to
    fp32: the same values and the same gradients (on the rows read; 0 on the others), to fp32 tolerance."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 50, generator=g, dtype=torch.float64) * 3
    rows, labels = torch.randperm(300, generator=g)[:170], torch.randint(0, 50, (170,), generator=g)
    ours_in = base.to(dtype).requires_grad_(True)
    plain_in = base.to(dtype).requires_grad_(True)
    # a scaled copy is what passes.py hands over (the logits divided by the temperature): it may be overwritten
    ours = logits.token_log_probs(ours_in * 1, rows, labels, inplace_backward=inplace)
    plain = core.logprobs_from_logits(plain_in[rows], labels)
    weights = torch.randn(170, generator=g, dtype=ours.dtype)
    (ours * weights).sum().backward()
    (plain * weights).sum().backward()
    tol = dict(rtol=1e-6, atol=1e-6) if dtype != torch.float64 else {}
    torch.testing.assert_close(ours, plain, **tol)
    torch.testing.assert_close(ours_in.grad, plain_in.grad, **tol)


def test_token_log_probs_work_in_chunks_bounded_by_a_share_of_the_logits():
    assert logits.chunk_rows(16384, 151936) == 256  # 1/64 of the rows at Qwen2.5's vocabulary
    assert logits.chunk_rows(2048, 151936) == 32
    assert logits.chunk_rows(300, 50) >= 300  # a small tensor: one chunk
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 1200, generator=g)  # 18 MiB of fp32: several chunks
    rows, labels = torch.arange(0, 4000, 2), torch.randint(0, 1200, (2000,), generator=g)
    torch.testing.assert_close(logits.token_log_probs(x, rows, labels), core.logprobs_from_logits(x[rows], labels))


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_token_entropy_equals_the_plain_one_values_and_gradients(chunk_size):
    x = torch.randn(37, 50, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([3, 0, 36, 5, 6, 7, 8, 9, 10, 20, 21, 22, 30])
    ours = logits.token_entropy(x, rows, chunk_size=chunk_size)
    (g_ours,) = torch.autograd.grad(ours.sum(), x)
    plain = core.entropy_from_logits(x[rows])
    (g_plain,) = torch.autograd.grad(plain.sum(), x)
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(g_ours, g_plain)


@pytest.mark.parametrize("chunk_size,checkpointing", [(None, True), (5, False), (5, True)])
def test_entropy_variants_equal_the_plain_entropy(chunk_size, checkpointing):
    x = torch.randn(23, 40, dtype=torch.float64, requires_grad=True)
    rows = torch.arange(23)
    fn = make_entropy_fn(chunk_size=chunk_size, checkpointing=checkpointing, compile=False)
    out = fn(x, rows)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, core.entropy_from_logits(x))
    torch.testing.assert_close(grad, torch.autograd.grad(core.entropy_from_logits(x).sum(), x)[0])


def saved_storages(fn, vocab: int) -> dict[int, int]:
    """{storage address: bytes} of the (.., vocab)-shaped tensors autograd keeps for backward while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == vocab:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def test_what_the_update_keeps_for_backward_with_and_without_entropy(model_and_batch):
    """The log-prob keeps the logits once (fp32 here) and a value per token; the entropy adds values per token only:
    no other (tokens x vocab) tensor, fp32 copy or softmax, beside the logits (verl's GPU path keeps the same)."""
    model, batch = model_and_batch
    n_tokens = int(batch["attention_mask"].sum())  # the packed row: every valid token
    logits_bytes = 4 * n_tokens * model.config.vocab_size
    n_response = int(batch["response_mask"].sum())

    def run(entropy_fn):
        out = forward_response(model, batch, kind="actor", rmpad=True, prompt_width=P, entropy_fn=entropy_fn)
        return sum(v.sum() for v in out.values())

    for name, fn in {
        "log-prob": None,
        "+ entropy": make_entropy_fn(chunk_size=None, checkpointing=False, compile=False),
        "+ checkpointed entropy": make_entropy_fn(chunk_size=None, checkpointing=True, compile=False),
        "+ entropy in chunks of 5": make_entropy_fn(chunk_size=5, checkpointing=False, compile=False),
    }.items():
        kept = saved_storages(lambda: run(fn), model.config.vocab_size)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        vocab_sized = sorted(b for ptr, b in kept.items() if ptr not in weights)
        print(f"{name}: (tokens x vocab) tensors kept for backward: {vocab_sized} B ({n_response} response tokens)")
        assert vocab_sized == [logits_bytes], name
    with torch.no_grad():
        assert saved_bytes(lambda: run(None)) == 0


@pytest.mark.parametrize("rmpad", [True, False])
def test_the_updates_backward_makes_no_tokens_x_vocab_tensor(model_and_batch, rmpad):
    """Without the entropy in the loss, the log-prob's gradient is written into the logits and flows to the LM head as
    it is: no new (.., vocab) tensor in backward (verl's in-place cross-entropy; an indexed or copied logits tensor
    would make one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, batch = model_and_batch
    vocab = model.config.vocab_size
    # the logits' rows: every valid token packed, or every position of the padded rows
    rows = int(batch["attention_mask"].sum()) if rmpad else batch["input_ids"].numel()

    class VocabSized(TorchDispatchMode):
        """The new tensors (not written in place) as large as the logits that the body makes."""

        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                fresh = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given  # no view, no _
                if fresh and t.dim() and t.shape[-1] == vocab and t.numel() >= rows * vocab:
                    self.made.append(f"{func} -> {tuple(t.shape)}")
            return out

    out = forward_response(model, batch, kind="actor", rmpad=rmpad, prompt_width=P)
    loss = (out["log_prob"] * batch["response_mask"]).sum()
    with VocabSized() as seen:
        loss.backward()
    model.zero_grad(set_to_none=True)
    assert seen.made == [], seen.made


def test_pad_to_length_changes_no_output(model_and_batch):
    model, batch = model_and_batch
    with torch.no_grad():
        plain = forward_response(model, batch, kind="actor", rmpad=True, prompt_width=P)
        padded = forward_response(model, batch, kind="actor", rmpad=True, prompt_width=P, pad_to_multiple=64)
    torch.testing.assert_close(padded["log_prob"], plain["log_prob"], rtol=1e-5, atol=1e-5)
