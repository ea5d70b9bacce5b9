"""trainer/engine/parallelize.py: a role's knobs applied in one order (checkpointing -> compile -> FSDP -> offload),
each step seeing what the one before made, on a real tiny Qwen2 sharded by FSDP1 and FSDP2 over a one-rank gloo
group in this process."""

import pytest
import torch

from trainer.engine import parallelize as pz
from trainer.engine.logits import token_entropy
from trainer.engine.offload import ActivationOffload, offload_layers
from trainer.engine.parallel import Sharded, ShardKnobs

CPU = torch.device("cpu")


def _tiny_model(layers: int = 2):
    from transformers import Qwen2ForCausalLM

    from trainer.config import TinyModelConfig
    from trainer.engine.models import build_tokenizer, tiny_qwen2_config

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(TinyModelConfig(num_hidden_layers=layers), len(build_tokenizer()), 64))


def _storages(sharded: Sharded) -> set[int]:
    """Where this rank's parameter shards live (FSDP2's DTensors by their local shard)."""
    return {getattr(p, "_local_tensor", p).data_ptr() for p in sharded.module.parameters()}


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_steps_run_in_order_each_on_what_the_one_before_made(one_rank, monkeypatch, strategy):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _tiny_model(3)  # verl's activation offload needs 3 layers or more
    seen: list[tuple[str, bool, bool]] = []  # (step, checkpointing on, the model wrapped) as each step began
    real = {step: getattr(pz, f"apply_{step}") for step in ("checkpointing", "compile", "fsdp", "offload")}
    moves: list[tuple] = []  # param_offload's moves: (device, copy)
    move_params = pz.move_params

    def spy(step):
        def call(*args, **kwargs):
            wrapped = isinstance(args[0], Sharded) and isinstance(args[0].module, (FSDP, FSDPModule))
            seen.append((step, model.is_gradient_checkpointing, wrapped))
            return real[step](*args, **kwargs)

        return call

    for step in real:
        monkeypatch.setattr(pz, f"apply_{step}", spy(step))
    monkeypatch.setattr(
        pz, "move_params", lambda sh, dev, copy: moves.append((dev, copy)) or move_params(sh, dev, copy=copy)
    )
    knobs = pz.ModelKnobs(
        shard=ShardKnobs(strategy=strategy),
        gradient_checkpointing=True,
        entropy_checkpointing=True,
        param_offload=True,
        activation_offload=True,
        offload_on_cpu=True,
    )
    sharded = pz.parallelize(model, knobs, device=CPU, name="actor", notes=[])

    assert [s[0] for s in seen] == ["checkpointing", "compile", "fsdp", "offload"]
    assert seen == [
        ("checkpointing", False, False),
        ("compile", True, False),
        ("fsdp", True, False),
        ("offload", True, True),
    ]
    units = FSDP.fsdp_modules(sharded.module) if strategy == "fsdp" else sharded.blocks
    assert len(sharded.blocks) == model.config.num_hidden_layers
    assert len(units) == len(sharded.blocks) + (strategy == "fsdp")  # FSDP1 lists the root among its units
    assert strategy == "fsdp" or all(isinstance(b, FSDPModule) for b in sharded.blocks)
    assert moves == [(CPU, True)]  # param_offload: the shards to host memory, a real copy (offload_on_cpu)
    assert isinstance(sharded.activation_offload, ActivationOffload)
    layers = offload_layers(sharded)  # the blocks, and under FSDP2 the untied lm_head (verl shards it apart)
    assert layers[:3] == list(sharded.blocks) and len(layers) == 3 + (strategy == "fsdp2")
    assert len(sharded.activation_offload.hooks) == 2 * len(layers)  # a pre- and a post-hook per layer
    # both knobs: HF's checkpointing swapped for verl's reentrant checkpoint of each layer inside the offload hooks
    assert not model.is_gradient_checkpointing and all("forward" in vars(layer) for layer in layers)
    assert sharded.entropy_fn.__name__ == "checkpointed"  # entropy_checkpointing: the compile step's head
    logits, rows = torch.randn(7, 11), torch.arange(7)
    torch.testing.assert_close(sharded.entropy_fn(logits, rows), token_entropy(logits, rows))


def test_the_offload_step_does_nothing_on_a_cpu_unless_asked(one_rank):
    knobs = pz.ModelKnobs(shard=ShardKnobs(strategy="fsdp2"), param_offload=True, activation_offload=True)
    sharded = pz.apply_fsdp(_tiny_model(), knobs, device=CPU, name="actor", notes=[])
    where = _storages(sharded)
    pz.apply_offload(sharded, knobs, CPU)
    assert _storages(sharded) == where and sharded.activation_offload is None


def test_the_compile_step_builds_the_entropy_head_from_its_knobs():
    plain = pz.apply_compile(pz.ModelKnobs(entropy_chunk_size=5))
    assert plain.func is token_entropy and plain.keywords == {"chunk_size": 5, "stats": pz.entropy_stats}
    compiled = pz.apply_compile(pz.ModelKnobs(compile_entropy=True))
    assert compiled.keywords["stats"] is pz.compiled_entropy()  # one compiled graph per process
