"""Start-up as verl does it (rank 0 loads, the others build on the meta device): the weights every rank
ends with are rank 0's, and an LM head tied to its embedding stays tied (one parameter, one gradient)."""

import json

import pytest
from torchrun import torchrun

from support import REPO, TINY_BASE

pytestmark = pytest.mark.slow  # torchrun of real FSDP ranks


def test_tied_checkpoint_stays_tied_and_every_rank_holds_rank0s_weights(tmp_path):
    from transformers import Qwen2ForCausalLM

    from trainer.config import TinyModelConfig
    from trainer.engine.models import build_tokenizer, tiny_qwen2_config

    tok = build_tokenizer()
    cfg = tiny_qwen2_config(TinyModelConfig(), len(tok), 128)
    cfg.tie_word_embeddings = True
    model = Qwen2ForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out.json"
    worker = REPO / "tests" / "trainer" / "init_worker.py"
    torchrun(worker, tmp_path / "ckpt", out, TINY_BASE, nproc=2, timeout=600)
    got = json.loads(out.read_text())
    groups = got.pop("groups_after_rewraps")
    assert got == {s: {"tied": True, "ranks_agree": True} for s in ("fsdp", "fsdp2")}, got
    assert groups[0] > 1 and groups == [groups[0]] * 3, groups  # hybrid groups made once, not per re-wrap
