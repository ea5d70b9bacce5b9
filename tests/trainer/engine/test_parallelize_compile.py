"""``use_torch_compile``: the entropy is compiled once per shape family, not once per micro-batch token count
(dynamo's recompile limit would otherwise be reached after a few steps of token-budget micro-batches, each
recompile inside a measured step, then eager from there on, silently), chunked or not."""

import pytest
import torch

from trainer.engine.core import entropy_from_logits
from trainer.engine.parallelize import make_entropy_fn
from trainer.rank.trial import compiled_graphs

pytestmark = pytest.mark.slow  # inductor compiles C++ on a CPU (seconds)

TOKEN_COUNTS = (37, 52, 64, 91, 130, 29)  # never a multiple of the chunk size: a remainder chunk each time


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_one_compile_serves_every_token_count(chunk_size):
    fn = make_entropy_fn(chunk_size=chunk_size, checkpointing=False, compile=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        fn(torch.randn(23, 40, generator=g), torch.arange(23))  # the first call compiles (a trial's warm-up step)
        before = compiled_graphs()
        for n in TOKEN_COUNTS:
            logits = torch.randn(n, 40, generator=g)
            rows = torch.randperm(n, generator=g)[: n - 3]  # the rows that predict a response token
            torch.testing.assert_close(fn(logits, rows), entropy_from_logits(logits[rows]), rtol=1e-5, atol=1e-5)
    assert compiled_graphs() == before, "the compiled entropy recompiled for new token counts"
