"""The offload knobs' own logic on a CPU (trainer/engine/offload.py): activation offload's choice of what to move
(never a weight a layer saves, each distinct activation once) and its round trip (the same gradients, bit for bit,
also where the allocator hands a freed activation's address to the next one; each saved tensor back with the sizes
and strides it was saved with, which a compiled backward checks). The copies themselves are pinned and
non-blocking only on a GPU (tests/trainer/engine/test_gpu.py runs them there)."""

import contextlib

import pytest
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

    offload = ActivationOffload(list(model))  # every layer a block
    seen: list[tuple[torch.Tensor, bool, bool]] = []  # (saved tensor, moved, saved inside a block)
    decide = offload.offloads
    offload.offloads = lambda t: seen.append((t, decide(t), bool(offload.noted))) or seen[-1][1]
    got = _gradients(model, x, offload)

    assert all(torch.equal(a, b) for a, b in zip(got, base))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved = [t for t, yes, _ in seen if yes]
    assert moved, "no activation was offloaded"
    assert not [t for t in moved if t.untyped_storage().data_ptr() in weights], "a weight was offloaded"
    kept = {t.untyped_storage().data_ptr() for t, yes, inside in seen if inside and not yes}
    assert kept and kept <= weights, "the weights the linear layers save (and only they) should have stayed"
    # the loss's square saves the model's output outside every block: it stays
    assert [t for t, yes, inside in seen if not inside and not yes]
    # nothing held after the forward: no copy, no noted weight (an address is noted only while its block runs)
    assert not offload.active and not offload.copies and not offload.weights


def test_activation_offload_is_off_on_a_cpu_unless_asked():
    ctx = activation_offload_context(True, torch.device("cpu"))
    assert isinstance(ctx, contextlib.nullcontext)
    asked = activation_offload_context(True, torch.device("cpu"), on_cpu=True)
    assert isinstance(asked, torch.autograd.graph.save_on_cpu)


def _chain(width: int, seed: int, depth: int = 16) -> nn.Sequential:
    """``depth`` blocks of (Linear, Tanh, Linear, GELU): every activation of one width, each freed as soon as the
    next layer has read it, so the allocator hands its address to the next tensor of that size."""
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    )


@pytest.mark.parametrize("width", [16, 32, 64, 128])
def test_activation_offload_gives_the_plain_gradients_bit_for_bit_when_addresses_are_reused(width):
    """A host copy belongs to the tensor it was made from: a later tensor at a freed tensor's address (same size,
    same strides) gets its own copy, never the freed one's. The addresses packed are recorded: across the seeds
    some tensor must land where an earlier packed one was, or the test would prove nothing."""
    reused = 0
    for seed in range(5):
        model = _chain(width, seed)
        x = torch.randn(8, width, requires_grad=True)
        base = _gradients(model, x, contextlib.nullcontext())
        offload = ActivationOffload(list(model))
        seen: dict[int, int] = {}  # storage address -> packed tensors that had it

        def spy(t, pack=offload.pack_hook, seen=seen):
            ptr = t.untyped_storage().data_ptr()
            seen[ptr] = seen.get(ptr, 0) + 1
            return pack(t)

        offload.pack_hook = spy  # torch's saved_tensors_hooks pushes its pack_hook field on entry
        got = _gradients(model, x, offload)
        reused += sum(n - 1 for n in seen.values() if n > 1)
        for (name, _), a, b in zip(model.named_parameters(), got, base):
            assert torch.equal(a, b), f"width {width}, seed {seed}: {name}'s gradient differs from the plain run's"
    assert reused, f"width {width}: no address was reused across 5 seeds; the check needs reuse to mean anything"


def test_activation_offload_moves_nothing_saved_outside_the_blocks():
    """What the root saves (here the head's input, as an LM head's logits would be) stays on the device, as verl's
    per-layer offload leaves it."""
    torch.manual_seed(0)
    block, head = nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, 4)
    model = nn.Sequential(block, head)
    x = torch.randn(5, 8, requires_grad=True)
    offload = ActivationOffload([block])
    moved: list[torch.Tensor] = []
    pack = offload.pack_hook
    offload.pack_hook = lambda t: (moved.append(t) if offload.offloads(t) else None) or pack(t)
    with offload:
        hidden = block(x)
        inside = list(moved)
        model[1](hidden).sum().backward()
    assert inside and moved == inside, "only what the block saved went to the host"


# A compiled function of an attention-shaped activation handed over transposed, as HF attention hands q/k/v to its
# kernel (compiled flex attention on CUDA): AOTAutograd saves q as the forward had it, and the compiled backward
# checks the sizes and strides of what it reads back (torch Inductor's ``assert_size_stride``, emitted at the top of
# every compiled graph for its inputs).
_compiled = torch.compile(lambda q: q.sin() * q)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.proj(x).view(b, s, 4, 6).transpose(1, 2)  # (batch, heads, seq, head_dim), not contiguous
        return _compiled(q).transpose(1, 2).reshape(b, s, 24)[..., :8] + x


def test_a_compiled_backward_reads_back_the_layout_its_forward_saved():
    torch.manual_seed(0)
    model = nn.Sequential(_Attention(), _Attention(), _Attention())
    x = torch.randn(2, 3, 8, requires_grad=True)
    base = _gradients(model, x, contextlib.nullcontext())
    got = _gradients(model, x, ActivationOffload(list(model)))
    for (name, _), a, b in zip(model.named_parameters(), got, base):
        assert torch.equal(a, b), f"{name}'s gradient differs from the plain run's"


class _Keep(torch.autograd.Function):
    """Saves ``view`` for backward and records what backward reads back (sizes, strides, values)."""

    @staticmethod
    def forward(ctx, x, view, seen):
        ctx.save_for_backward(view)
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (view,) = ctx.saved_tensors
        ctx.seen.append((view.shape, view.stride(), view.clone()))
        return grad, None, None


_VIEWS = {
    "transposed": lambda h: h.transpose(0, 1),
    "a slice with an offset and gaps": lambda h: h[1:, 2:5],
    "expanded (stride 0)": lambda h: h[:1].expand(6, 8),
    "strided with an offset": lambda h: h[1::2, ::3],
    "contiguous": lambda h: h,
}


@pytest.mark.parametrize("view", list(_VIEWS))
def test_a_saved_view_comes_back_with_its_sizes_strides_and_values(view):
    """Every layout a block may save, non-overlapping and dense or not, comes back as it was saved, after its device
    tensor went (the first of two blocks: the last block's group stays on the device, as in verl)."""
    lin = nn.Linear(8, 8)
    x = torch.randn(6, 8, requires_grad=True)
    seen: list = []

    class Block(nn.Module):
        def forward(self, x):
            return _Keep.apply(x, _VIEWS[view](torch.tanh(lin(x))), seen)

    first, last = Block(), nn.Tanh()
    offload = ActivationOffload([first, last])
    with offload:
        out = last(first(x))
        h = _VIEWS[view](torch.tanh(lin(x)))  # the same values, to compare with
    entries = [r() for r in offload.groups[0]]
    assert any(e.device is None and e.host is not None for e in entries), "the view did not go to the host"
    out.sum().backward()
    (shape, stride, values) = seen[0]
    assert (shape, stride) == (h.shape, h.stride())
    assert torch.equal(values, h)


def test_the_device_cache_goes_back_where_verl_gives_it_back(monkeypatch):
    """``empty_device_cache`` on CUDA (after an offload, around the rollout's weight sync, as verl's calls): the
    allocator's cached free segments go back to the device, so NVML and a colocated engine see them free; proven with
    test_metrics_unmapped.py's FakeCuda (torch's ``release_cached_blocks``: the default pool's free segments only)."""
    from tests.trainer.engine.test_metrics_unmapped import GPU, FakeCuda, FakeDevice, MiB, Pool
    from trainer.engine.offload import empty_device_cache

    cuda = FakeCuda(FakeDevice(0, 1000 * MiB, 0), FakeDevice(1, 1000 * MiB, 0)).install(monkeypatch)
    kept = cuda.malloc(100 * MiB, GPU)
    cuda.free(cuda.malloc(300 * MiB, GPU), GPU)  # the offloaded shards' blocks: freed, still cached
    engine = cuda.malloc(200 * MiB, GPU, Pool())  # a vLLM pool's segment stays its pool's
    held = cuda.mem_get_info(GPU)[1] - cuda.mem_get_info(GPU)[0]
    empty_device_cache()
    assert held - (cuda.mem_get_info(GPU)[1] - cuda.mem_get_info(GPU)[0]) == 300 * MiB
    assert cuda.memory_reserved(GPU) == 300 * MiB  # the live tensor's segment and the engine's
    cuda.free(kept, GPU), cuda.free(engine, GPU)
