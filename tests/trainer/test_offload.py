"""The offload knobs' own logic on a CPU (trainer/engine/offload.py): activation offload's choice of what to move
(never a weight a layer saves, each distinct activation once) and its round trip (the same gradients). The
copies themselves are pinned and non-blocking only on a GPU (tests/trainer/test_gpu.py runs them there)."""

import contextlib

import torch
from torch import nn

from trainer.engine.offload import ActivationOffload, activation_offload_context


def _gradients(model: nn.Module, x: torch.Tensor, ctx) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x).pow(2).sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_activation_offload_moves_activations_not_weights_and_gives_the_same_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    base = _gradients(model, x, contextlib.nullcontext())

    offload = ActivationOffload([model, model[0], model[2]])
    seen: list[tuple[torch.Tensor, bool]] = []
    decide = offload.offloads
    offload.offloads = lambda t: seen.append((t, decide(t))) or seen[-1][1]
    got = _gradients(model, x, offload)

    assert all(torch.equal(a, b) for a, b in zip(got, base))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert weights <= offload.weights  # noted by the units' pre-forward hooks
    moved = [t for t, yes in seen if yes]
    assert moved, "no activation was offloaded"
    assert not [t for t in moved if t.untyped_storage().data_ptr() in weights], "a weight was offloaded"
    assert [t for t, yes in seen if not yes], "the weights the linear layers save should have stayed"
    assert not offload.active and not offload.copies  # nothing held after the forward


def test_activation_offload_is_off_on_a_cpu():
    ctx = activation_offload_context(True, torch.device("cpu"))
    assert isinstance(ctx, contextlib.nullcontext)
