"""The logits side of a step, as verl does it: entropy only where it is needed, chunked and
checkpointed variants equal to the plain one, and what each keeps for backward measured in bytes."""

import pytest
import torch

from trainer.config import TinyModelConfig
from trainer.engine import core
from trainer.engine.models import build_tokenizer, load_actor
from trainer.engine.roles import make_entropy_fn
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


def test_chunked_entropy_equals_the_plain_one_values_and_gradients():
    logits = torch.randn(37, 50, dtype=torch.float64, requires_grad=True)
    plain = core.entropy_from_logits(logits)
    (g_plain,) = torch.autograd.grad(plain.sum(), logits)
    chunked = core.entropy_from_logits_chunked(logits, chunk_size=8)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    torch.testing.assert_close(chunked, plain)
    torch.testing.assert_close(g_chunked, g_plain)


@pytest.mark.parametrize("chunk_size,checkpointing", [(None, True), (5, False), (5, True)])
def test_entropy_variants_equal_the_plain_entropy(chunk_size, checkpointing):
    logits = torch.randn(23, 40, dtype=torch.float64, requires_grad=True)
    fn = make_entropy_fn(chunk_size=chunk_size, checkpointing=checkpointing, compile=False)
    out = fn(logits)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    torch.testing.assert_close(out, core.entropy_from_logits(logits))
    torch.testing.assert_close(grad, torch.autograd.grad(core.entropy_from_logits(logits).sum(), logits)[0])


def test_what_the_update_keeps_for_backward_with_and_without_entropy(model_and_batch):
    model, batch = model_and_batch
    n_tokens = int(batch["response_mask"].sum())
    vocab = model.config.vocab_size

    def run(entropy_fn):
        out = forward_response(model, batch, kind="actor", rmpad=True, prompt_width=P, entropy_fn=entropy_fn)
        return sum(v.sum() for v in out.values())

    none = saved_bytes(lambda: run(None))
    plain = saved_bytes(lambda: run(make_entropy_fn(chunk_size=None, checkpointing=False, compile=False)))
    ckpt = saved_bytes(lambda: run(make_entropy_fn(chunk_size=None, checkpointing=True, compile=False)))
    per = 4 * n_tokens * vocab  # one fp32 (tokens x vocab) tensor
    print(f"saved for backward: no entropy {none} B, entropy {plain} B, checkpointed entropy {ckpt} B; 4NV = {per}")
    assert plain - none >= per  # the softmax (and more) kept for the entropy's backward
    assert ckpt - none < per  # checkpointing keeps only its input, which is already kept
    with torch.no_grad():
        assert saved_bytes(lambda: run(None)) == 0


def test_pad_to_length_changes_no_output(model_and_batch):
    model, batch = model_and_batch
    with torch.no_grad():
        plain = forward_response(model, batch, kind="actor", rmpad=True, prompt_width=P)
        padded = forward_response(model, batch, kind="actor", rmpad=True, prompt_width=P, pad_to_multiple=64)
    torch.testing.assert_close(padded["log_prob"], plain["log_prob"], rtol=1e-5, atol=1e-5)
