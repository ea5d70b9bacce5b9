"""What a run says about its rollout (trainer/engine/knob_notes.py, trainer/engine/rollout.py): the rollout it takes
when none is named, and a GPU run on HF generate saying that its generate phase is not production's (the note goes
into the result, and the report shows a trial's notes in its row)."""

from trainer.config import effective_config, load_config
from trainer.engine.knob_notes import HF_ROLLOUT_ON_GPU, knob_notes
from trainer.engine.rollout import with_rollout

BASE = "configs/tiny_cpu.yaml"


def _cfg(name):
    return effective_config(load_config(BASE, [f"actor_rollout_ref.rollout.name={name}"]))


def test_a_run_without_a_named_rollout_takes_hf_generate_on_a_cpu():
    cfg = _cfg("null")
    assert cfg.actor_rollout_ref.rollout.name is None
    assert with_rollout(cfg, "cpu").actor_rollout_ref.rollout.name == "hf"
    named = _cfg("vllm")
    assert with_rollout(named, "cpu") is named  # a named rollout is the config's


def test_hf_generate_on_a_gpu_says_it_is_not_productions_rollout():
    assert HF_ROLLOUT_ON_GPU in knob_notes(_cfg("hf"), "cuda")
    assert HF_ROLLOUT_ON_GPU not in knob_notes(_cfg("hf"), "cpu")  # the CPU demo's rollout
    assert HF_ROLLOUT_ON_GPU not in knob_notes(_cfg("vllm"), "cuda")
    assert "\n" not in HF_ROLLOUT_ON_GPU and not HF_ROLLOUT_ON_GPU.split(":")[1].strip().startswith("no effect")
