"""Run with verl's interpreter: ``PY verl_preset_check.py PRESET_DIR``.

Reads a ``ppotune make-preset verl`` preset the way verl 0.9.1's ``main_ppo`` does (its Hydra
config with the preset's overrides, ``HFModelConfig`` -> tokenizer, ``create_rl_dataset`` for
train and val, ``collate_fn``, ``get_custom_reward_fn``), and loads the model as actor and as
critic: no Ray, no training. Prints one JSON line of facts for the test to assert on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
import verl
import yaml
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.trainer.ppo.utils import create_rl_dataset
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.dataset.rl_dataset import collate_fn
from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder
from verl.workers.config import HFModelConfig


def main(preset: Path) -> dict:
    overrides = yaml.safe_load((preset / "preset.yaml").read_text())["overrides"]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)

    # step 1. the tokenizer, as main_ppo builds it; QwenContinuousTokenBuilder raises unless "\n" is one token.
    model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    tokenizer = model_config.tokenizer
    QwenContinuousTokenBuilder(tokenizer)
    text = "héllo 世界 🙂\n12+34=\t"
    roundtrip = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text

    # step 2. the datasets, as main_ppo builds them (the overlong-prompt filter included).
    train = create_rl_dataset(config.data.train_files, config.data, tokenizer, model_config.processor, is_train=True)
    val = create_rl_dataset(config.data.val_files, config.data, tokenizer, model_config.processor, is_train=False)
    batch = collate_fn([train[i] for i in range(4)])
    prompt_lengths = [
        len(
            tokenizer.apply_chat_template(train[i]["raw_prompt"], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for i in range(len(train))
    ]

    # step 3. the reward function verl will call, on a right and a wrong answer.
    reward_fn = get_custom_reward_fn(config)
    row = train[0]
    truth = row["reward_model"]["ground_truth"]
    right = reward_fn(
        data_source=row["data_source"], solution_str=truth, ground_truth=truth, extra_info=row["extra_info"]
    )
    wrong = reward_fn(
        data_source=row["data_source"], solution_str="x", ground_truth=truth, extra_info=row["extra_info"]
    )

    # step 4. the model: actor (generates) and critic (token classification, one label), as verl loads them.
    path = config.actor_rollout_ref.model.path
    actor = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    enc = tokenizer(
        tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False),
        return_tensors="pt",
        add_special_tokens=False,
    )
    generated = actor.generate(**enc, max_new_tokens=4, do_sample=False)
    critic = AutoModelForTokenClassification.from_pretrained(
        config.critic.model.path, num_labels=1, local_files_only=True, dtype=torch.float32
    )
    values = critic(**enc).logits

    return {
        "verl": verl.__version__,
        "transformers": transformers.__version__,
        "tokenizer_class": type(tokenizer).__name__,
        "newline_ids": tokenizer.encode("\n", add_special_tokens=False),
        "roundtrip": roundtrip,
        "train_len": len(train),
        "val_len": len(val),
        "batch_keys": sorted(batch),
        "max_prompt_length": int(config.data.max_prompt_length),
        "longest_prompt": max(prompt_lengths),
        "reward_right": right,
        "reward_wrong": wrong,
        "generated_new_tokens": int(generated.shape[1] - enc["input_ids"].shape[1]),
        "critic_values_shape": list(values.shape),
        "vocab_size": actor.config.vocab_size,
        "tokenizer_len": len(tokenizer),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
