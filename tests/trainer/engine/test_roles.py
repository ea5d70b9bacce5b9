"""The worst-case probe's trainer side, without a process group: prompts made exactly max_prompt_length real
tokens, the fullest micro-batch each phase's plan makes of full-length sequences (the step's own partitioning),
the notes, and the config key."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config
from trainer.engine.data import PromptDataset, extend_prompt, synthetic_rows
from trainer.engine.roles import MicroBatching, Plans, StepSettings, fullest_micro_batches
from trainer.engine.rollout import Sampling


# --------------------------------------------------------------------------- prompts
def test_a_prompt_is_its_own_tokens_repeated_from_the_left_to_exactly_the_length():
    ids = [5, 6, 7]
    assert extend_prompt(ids, 8) == [6, 7, 5, 6, 7, 5, 6, 7]
    assert extend_prompt(ids, 3) == ids  # already the length: unchanged
    assert extend_prompt(ids, 2) == [6, 7]  # longer (cannot happen after truncation): the end kept
    assert extend_prompt([9], 4) == [9, 9, 9, 9]
    out = extend_prompt(list(range(10, 27)), 100)
    assert len(out) == 100 and out[-17:] == list(range(10, 27)) and set(out) == set(range(10, 27))
    assert extend_prompt(list(range(10, 27)), 100) == out  # deterministic


def test_an_empty_prompt_or_a_length_of_zero_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        extend_prompt([], 4)
    with pytest.raises(ValueError, match="length must be > 0"):
        extend_prompt([1], 0)


def test_every_templated_prompt_becomes_max_prompt_length_real_tokens():
    from trainer.engine.models import build_tokenizer

    tok = build_tokenizer()
    rows = synthetic_rows(num_prompts=40, min_terms=2, max_terms=16, length_alpha=1.2, seed=0)
    built = PromptDataset.build(rows, tok, max_prompt_length=200, truncation="error")
    typical = sorted(len(ids) for ids in built.input_ids)
    assert typical[-1] < 200 and typical[0] < typical[-1]  # short and skewed before
    worst = built.at_length(200)
    generation_prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for before, after in zip(built.input_ids, worst.input_ids):
        assert len(after) == 200
        assert after[-len(before) :] == before  # the prompt itself, then generation starts where it did
        assert after[-len(generation_prompt) :] == generation_prompt
        assert tok.pad_token_id not in after  # real tokens: remove-padding would drop pad tokens
    assert worst.ground_truths == built.ground_truths and len(worst) == len(built)


# --------------------------------------------------------------------------- packing
def _settings(*, actor_mini: int, critic_mini: int) -> StepSettings:
    sampling = Sampling(
        max_response_length=32,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        do_sample=True,
        ignore_eos=True,
        pad_id=0,
        eos_id=1,
        vocab_limit=100,
    )
    return StepSettings(
        sampling=sampling,
        ppo_mini_batch_size_per_gpu=actor_mini,
        critic_mini_batch_size_per_gpu=critic_mini,
        ppo_epochs=1,
        critic_epochs=1,
        gamma=1.0,
        lam=1.0,
        use_kl_in_reward=False,
        kl_penalty="kl",
        cliprange_value=0.5,
        critic_grad_clip=1.0,
        actor_loss=None,
        train_batch_size=16,
        rollout_n=1,
    )


def test_the_fullest_micro_batch_of_full_length_sequences_per_phase():
    # 8 sequences of 96 tokens on a rank. By hand: a 256-token budget holds floor(256 / 96) = 2 of them
    # (4 balanced micro-batches of 192); 300 holds 3 (ceil(8 x 96 / 300) = 3 micro-batches: 3, 3, 2);
    # a fixed size holds its size whatever the lengths.
    plans = Plans(
        actor=MicroBatching(True, None, 256),
        critic=MicroBatching(False, 2, 4096),
        critic_forward=MicroBatching(True, None, 300),
        ref=MicroBatching(False, 4, 4096),
        rollout_log_prob=MicroBatching(True, None, 96),
    )
    got = fullest_micro_batches(plans, _settings(actor_mini=8, critic_mini=4), [96] * 8)
    assert got == {
        "old_log_prob": (1, 96, 96),  # a budget of exactly one sequence (the least validation allows)
        "ref": (4, 384, None),
        "values": (3, 288, 300),
        "update_critic": (2, 192, None),
        "update_actor": (2, 192, 256),
    }
    # the actor's mini-batch of 2 sequences caps what a 1024-token budget can gather
    plans = Plans(*(MicroBatching(True, None, 1024),) * 5)
    got = fullest_micro_batches(plans, _settings(actor_mini=2, critic_mini=8), [96] * 8)
    assert got["update_actor"] == (2, 192, 1024) and got["update_critic"] == (8, 768, 1024)
    assert got["ref"] == (8, 768, 1024)


def test_the_worst_case_notes_say_the_lengths_and_the_packing():
    from trainer.engine.roles import Roles, worst_case_notes

    plans = Plans(*(MicroBatching(True, None, 256),) * 5)
    roles = Roles(None, None, None, None, None, plans, _settings(actor_mini=4, critic_mini=4))
    notes = worst_case_notes(roles, num_rows=8, prompt_length=64, response_length=32)
    assert notes[0] == "worst case: every prompt 64 tokens, every response 32 tokens (EOS ignored)"
    assert "8 sequences per rank" in notes[1]
    assert "update_actor 2 x 96 = 192 tokens (of a 256-token budget)" in notes[1]


# --------------------------------------------------------------------------- the key
def test_the_key_is_a_validated_bool_off_by_default():
    assert load_config(None).ppotune.worst_case is False
    assert load_config(None, ["ppotune.worst_case=true"]).ppotune.worst_case is True
    with pytest.raises(ConfigError, match=r"^the command line \(-o\): ppotune\.worst_case: expected bool"):
        load_config(None, ["ppotune.worst_case=3"])
    with pytest.raises(ConfigError, match=r"ppotune\.worst_case: .*saves no checkpoint"):
        load_config(None, ["ppotune.worst_case=true", "trainer.default_local_dir=/tmp/x"])
