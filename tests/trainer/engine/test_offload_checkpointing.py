"""Activation offload as verl 0.9.1's ``utils/activation_offload.py::enable_activation_offloading`` installs it
(trainer/engine/parallelize.py::apply_offload, trainer/engine/offload.py): with gradient checkpointing on, HF's
checkpointing is switched off and each layer's forward is a reentrant checkpoint inside the offload hooks
(``ActivationHandler._ckpt_forward``), so each layer's checkpointed input goes to host memory, with the plain run's
gradients bit for bit; with fewer than 3 layers the offload is off, with a note. A real tiny Qwen2 sharded by FSDP1
and FSDP2 over a one-rank gloo group in this process, the hooks run on a CPU (``offload_on_cpu``)."""

import pytest
import torch

from trainer.engine import offload as ofl
from trainer.engine import parallelize as pz
from trainer.engine.parallel import ShardKnobs

CPU = torch.device("cpu")
ROWS, WIDTH = 3, 12


def _model(layers: int, *, tied: bool = False):
    from transformers import Qwen2ForCausalLM

    from trainer.config import TinyModelConfig
    from trainer.engine.models import build_tokenizer, tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(TinyModelConfig(num_hidden_layers=layers), len(build_tokenizer()), 64)
    config.tie_word_embeddings = tied
    return Qwen2ForCausalLM(config)


def _build(strategy: str, layers: int, *, checkpointing: bool, offload: bool, notes=None, tied: bool = False):
    knobs = pz.ModelKnobs(
        shard=ShardKnobs(strategy=strategy),
        gradient_checkpointing=checkpointing,
        activation_offload=offload,
        offload_on_cpu=True,
    )
    name = "actor_rollout_ref.actor.fsdp_config"
    sharded = pz.parallelize(
        _model(layers, tied=tied), knobs, device=CPU, name=name, notes=[] if notes is None else notes
    )
    sharded.module.train()
    return sharded


def _hf(sharded):
    """The HF model inside (FSDP1 wraps it; FSDP2 is it)."""
    return sharded.module.module if sharded.strategy == "fsdp" else sharded.module


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 60, (ROWS, WIDTH), generator=g)
    mask = torch.ones(ROWS, WIDTH, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded row: the attention mask is a real argument of every layer
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _gradients(sharded) -> dict[str, torch.Tensor]:
    """One training forward (inside the offload context, as trainer/engine/passes.py runs it) and backward; -> every
    parameter's gradient."""
    ids, mask, pos = _batch()
    sharded.module.zero_grad(set_to_none=True)
    ctx = ofl.activation_offload_context(True, CPU, sharded, on_cpu=True)
    with ctx:
        logits = sharded.module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    logits.float().log_softmax(-1).mean().backward()
    return {n: p.grad.clone() for n, p in sharded.module.named_parameters()}


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_with_checkpointing_each_layers_input_goes_to_the_host_with_the_plain_runs_gradients(
    one_rank, monkeypatch, strategy
):
    layers = 3
    plain = _gradients(_build(strategy, layers, checkpointing=False, offload=False))
    hf_checkpointed = _gradients(_build(strategy, layers, checkpointing=True, offload=False))

    sharded = _build(strategy, layers, checkpointing=True, offload=True)
    offload = sharded.activation_offload
    assert isinstance(offload, ofl.ActivationOffload)
    assert not _hf(sharded).is_gradient_checkpointing  # HF's switched off, as verl does
    copied: list[tuple[int, torch.Size]] = []  # (group, size) of each host copy made
    copy_out = ofl._Saved.copy_out
    monkeypatch.setattr(
        ofl._Saved, "copy_out", lambda self: copied.append((len(offload.groups) - 1, self.size)) or copy_out(self)
    )
    got = _gradients(sharded)

    hidden = torch.Size([ROWS, WIDTH, sharded.module.config.hidden_size])
    groups = ofl.offload_layers(sharded)
    # every layer's checkpointed input (its hidden states) copied out with its group, but the last layer's group
    # (verl's num_offload_group = layers - 1); the first block's input is the embedding's output
    offloaded = len(groups) - 1
    assert sorted({g for g, size in copied if size == hidden}) == list(range(offloaded))
    # the reentrant checkpoint saves only the layer's inputs: its own activations are recomputed in backward
    assert all(size != torch.Size([ROWS, WIDTH, sharded.module.config.intermediate_size]) for _, size in copied)
    assert got.keys() == plain.keys()
    assert [n for n in plain if not torch.equal(got[n], hf_checkpointed[n])] == []
    assert [n for n in plain if not torch.equal(got[n], plain[n])] == []


def test_with_fewer_than_3_layers_activation_offload_is_off_and_checkpointing_stays_hfs(one_rank):
    notes: list[str] = []
    sharded = _build("fsdp", 2, checkpointing=True, offload=True, notes=notes)
    assert len(ofl.offload_layers(sharded)) == 2 and sharded.activation_offload is None
    assert _hf(sharded).is_gradient_checkpointing  # verl returns before it switches HF's off
    assert any("enable_activation_offloading" in n and n.startswith("actor_rollout_ref.model.") for n in notes)
    ctx = ofl.activation_offload_context(True, CPU, sharded, on_cpu=True)
    assert not isinstance(ctx, ofl.ActivationOffload)  # the hooks are not built on first use either


def test_fsdp2_counts_an_untied_lm_head_as_verl_shards_it_apart(one_rank):
    untied = _build("fsdp2", 2, checkpointing=False, offload=True)
    assert len(ofl.offload_layers(untied)) == 3 and ofl.offload_layers(untied)[-1] is untied.module.lm_head
    assert isinstance(untied.activation_offload, ofl.ActivationOffload)
    tied = _build("fsdp2", 2, checkpointing=False, offload=True, tied=True)
    assert len(ofl.offload_layers(tied)) == 2 and tied.activation_offload is None


def test_a_checkpointed_forward_whose_inputs_need_no_gradient_runs_plain():
    """A reentrant checkpoint over inputs none of which needs a gradient gives the layer's weights none (torch warns
    "None of the inputs have requires_grad=True"): such a forward runs plain, with its gradients."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    layer(x).sum().backward()
    plain = layer.weight.grad.clone()
    layer.zero_grad()
    ofl.checkpoint_forward(layer)
    layer(x).sum().backward()
    assert torch.equal(layer.weight.grad, plain)
    layer.zero_grad()
    y = x.clone().requires_grad_()
    layer(y).sum().backward()  # a checkpoint: its weight's gradient from the recompute
    assert torch.equal(layer.weight.grad, plain) and y.grad is not None
