"""Activation offload's window and stream order (trainer/engine/offload.py:ActivationOffload) against verl 0.9.1's
``utils/activation_offload.py:AsyncDoubleBufferGroupOffloadHandler``: one group per block; at each block boundary,
forward and backward, which groups are on the device and which in host memory; and the order of the stream waits and
side-stream copies, compared call for call with verl's own handler run in verl's venv on a fake device that records
them. The streams themselves are CUDA's; on a CPU the same window runs with every copy in program order."""

import contextlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.engine.offload import ActivationOffload

VERL_PY = Path(__file__).resolve().parents[3] / ".venv-verl" / "bin" / "python"
DEPTH = 4


def _chain(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU()) for _ in range(DEPTH)])


def _where(offload: ActivationOffload) -> list[set[str]]:
    """Per group, where its live entries are: "d" device only, "h" host only, "dh" both (copying out, or back)."""
    entries = [[r() for r in group] for group in offload.groups]
    return [
        {("d" if e.device is not None else "") + ("h" if e.host is not None else "") for e in g if e} for g in entries
    ]


def _boundaries(model: nn.Sequential, offload: ActivationOffload, on_forward, on_backward) -> None:
    """``on_forward(g)`` as block g's forward ends, after the offload's own hook; ``on_backward(g)`` as block g's
    backward starts, after the offload's."""

    def ended(g, module, args, out):
        on_forward(g)
        out.register_hook(lambda grad: on_backward(g))

    for g, block in enumerate(model):
        block.register_forward_hook(lambda m, a, o, g=g: ended(g, m, a, o))


def test_one_group_per_block_is_held_on_the_device_until_the_next_block_ends_and_prefetched_one_block_ahead():
    """verl's window (``num_offload_group`` = blocks - 1): after block g's forward, groups before g are in host memory
    only and group g is on the device, copying out unless it is the last; as block g's backward starts, group g-1 is
    back on the device (prefetched while block g runs its backward) and the groups before it are still on the host.
    Gradients bit for bit the plain run's."""
    model = _chain()
    x = torch.randn(5, 8, requires_grad=True)
    model(x).pow(2).sum().backward()
    base = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    offload = ActivationOffload(list(model))
    seen_fwd: dict[int, list[set[str]]] = {}
    seen_bwd: dict[int, list[set[str]]] = {}
    _boundaries(
        model,
        offload,
        lambda g: seen_fwd.__setitem__(g, _where(offload)),
        lambda g: seen_bwd.__setitem__(g, _where(offload)),
    )
    with offload:
        loss = model(x).pow(2).sum()
    loss.backward()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), base))
    last = DEPTH - 1
    for g in range(DEPTH):
        groups = seen_fwd[g]
        assert len(groups) == g + 1 and all(groups), (g, groups)
        assert all(groups[j] == {"h"} for j in range(g)), (g, groups)
        assert groups[g] == ({"d"} if g == last else {"dh"}), (g, groups)
    for g in range(DEPTH):
        groups = seen_bwd[g]
        assert all(groups[j] == {"h"} for j in range(g - 1)), (g, groups)
        if g >= 1:
            assert groups[g - 1] == {"dh"}, (g, groups)
        assert groups[g] == ({"d"} if g == last else {"dh"}), (g, groups)


# verl's handler, driven through DEPTH groups forward then backward, on a fake device whose streams record each wait
# and each side-stream context (verl.utils.device.get_torch_device stands for torch.cuda there); its copies are
# replaced by clones (no pinned memory on a CPU).
_VERL = r"""
import contextlib, json, sys, torch
import verl.utils.activation_offload as ao
log = []
class Stream:
    def __init__(self, name): self.name = name
    def wait_stream(self, other): log.append(["wait", self.name, other.name])
class Device:
    def __init__(self): self.names, self.compute = iter(["d2h", "h2d"]), Stream("compute")
    def Stream(self): return Stream(next(self.names))
    def current_stream(self): return self.compute
    def stream(self, s): log.append(["on", s.name]); return contextlib.nullcontext()
device = Device()
ao.get_torch_device = lambda: device
ao.SynchronizedGroupOffloadHandler.offload = staticmethod(lambda t, pin_memory=True: (t.device, t.clone()))
ao.SynchronizedGroupOffloadHandler.reload = staticmethod(lambda state, non_blocking=None: state[1].clone())
layers = int(sys.argv[1])
handler = ao.AsyncDoubleBufferGroupOffloadHandler(num_offload_group=layers - 1, num_model_group=layers)
tags = []
for g in range(layers):
    tags.append(handler.tensor_push(torch.randn(3)))
    log.append(["forward ends", g])
    handler.on_group_commit_forward()
for g in reversed(range(layers)):
    log.append(["backward starts", g])
    handler.on_group_commit_backward()
    handler.tensor_pop(tags[g])
print(json.dumps(log))
"""


class _Recorder:
    """trainer/engine/offload.py's ``_Streams`` interface, recording what verl's fake device records."""

    def __init__(self, log: list) -> None:
        self.log, self.d2h, self.h2d = log, "d2h", "h2d"

    def compute(self):
        return None  # no record_stream on a CPU tensor

    def on(self, side):
        self.log.append(["on", side])
        return contextlib.nullcontext()

    def side_waits(self, side) -> None:
        self.log.append(["wait", side, "compute"])

    def compute_waits(self, side) -> None:
        self.log.append(["wait", "compute", side])


def _ours(log: list) -> None:
    model = _chain()
    offload = ActivationOffload(list(model))
    offload.streams = _Recorder(log)  # kept: only a CUDA tensor saved replaces it

    def ended(g, module, args, out):
        log.append(["forward ends", g])
        out.register_hook(lambda grad: log.append(["backward starts", g]))

    for g, block in enumerate(model):  # prepended: each marker before the offload's own hook
        block.register_forward_hook(lambda m, a, o, g=g: ended(g, m, a, o), prepend=True)
    with offload:
        loss = model(torch.randn(5, 8, requires_grad=True)).sum()
    loss.backward()


def test_the_stream_waits_and_side_stream_copies_come_in_verls_order():
    if not VERL_PY.is_file():
        pytest.skip("verl venv not installed (.venv-verl)")
    run = subprocess.run([str(VERL_PY), "-c", _VERL, str(DEPTH)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    verl = json.loads(run.stdout.strip().splitlines()[-1])
    ours: list = []
    _ours(ours)
    assert ["on", "d2h"] in verl and ["on", "h2d"] in verl  # the fake saw verl's copies at all
    assert ours == verl
