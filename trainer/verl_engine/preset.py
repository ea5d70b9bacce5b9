"""A tiny job that verl itself can run, built offline (``ppotune make-preset verl``: :mod:`tuner.commands.make_preset`).

The preset is what the verl engine's tests (and a user trying the engine) point verl at:

- ``model/``: a Qwen2 causal LM built from a config in code (random init, seeded) and a byte-level
  Qwen2 tokenizer: the special tokens + the 256 GPT-2 byte symbols, no merges, so any UTF-8 text
  encodes (one token per byte) and ``"\\n"`` is one token, which verl checks for Qwen models.
- ``data/{train,val}.parquet``: the embedded arithmetic task (:func:`trainer.engine.data.synthetic_rows`,
  Pareto-skewed prompt lengths) in verl's RL format, laid out like verl's
  ``examples/data_preprocess/gsm8k.py``.
- ``reward.py``: ``compute_score`` for ``reward.custom_reward_function``, a copy of
  :func:`trainer.engine.data.score_response` (verl loads it by path in its own venv, where ppotune is
  not installed).
- ``preset.yaml``: ``overrides:``, the verl Hydra overrides that point verl at the above.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from trainer.config import DataConfig, SyntheticDataConfig, TinyModelConfig

__all__ = [
    "PRESETS",
    "build_byte_tokenizer",
    "build_model",
    "verl_rows",
    "reward_source",
    "make_verl_preset",
]

PRESETS = ("verl",)
REWARD_FN_NAME = "compute_score"

# Qwen2's own names and roles: pad is <|endoftext|>, a chat turn ends with <|im_end|> (Qwen2.5-Instruct).
_ENDOFTEXT, _IM_START, _IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Prompt lengths are rounded up to this many tokens in data.max_prompt_length.
_LENGTH_ROUND = 8


def build_byte_tokenizer():
    """A byte-level ``Qwen2Tokenizer``: ids 0-255 are the bytes (GPT-2 byte-to-unicode symbols, in
    byte order), then ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; no merges, so a token is a
    byte. The chat template is the embedded tokenizer's (Qwen-style ``<|im_start|>role\\n...``)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from trainer.engine.models import _CHAT_TEMPLATE

    byte_symbol = bytes_to_unicode()
    vocab = {byte_symbol[b]: b for b in range(256)}
    for token in (_ENDOFTEXT, _IM_START, _IM_END):
        vocab[token] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,  # every byte is in the vocabulary: nothing is unknown
        eos_token=_IM_END,
        pad_token=_ENDOFTEXT,
        additional_special_tokens=[_IM_START, _IM_END],
    )
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def build_model(tokenizer, *, tiny: TinyModelConfig, max_positions: int, seed: int):
    """A seeded, randomly initialised ``Qwen2ForCausalLM`` whose vocabulary covers ``tokenizer``."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from trainer.engine.models import tiny_qwen2_config

    cfg = tiny_qwen2_config(tiny, len(tokenizer), max_positions)
    cfg.use_cache = True  # a checkpoint that generates too (verl's rollout), unlike the trainer's in-memory one
    cfg.pad_token_id = tokenizer.pad_token_id
    cfg.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    # Generation stops at the end of the turn or of the text, as Qwen2.5-Instruct's generation_config says.
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(_ENDOFTEXT)],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def verl_rows(*, synthetic: SyntheticDataConfig, num_val_prompts: int) -> tuple[list[dict], list[dict]]:
    """(train, val) rows in verl's RL format: one draw of :func:`trainer.engine.data.synthetic_rows`, split,
    with ``extra_info = {split, index}`` as verl's example preprocessors write it."""
    from trainer.engine.data import synthetic_rows

    rows = synthetic_rows(
        num_prompts=synthetic.num_prompts + num_val_prompts,
        min_terms=synthetic.min_terms,
        max_terms=synthetic.max_terms,
        length_alpha=synthetic.length_alpha,
        seed=synthetic.seed,
    )
    # "test" for the validation split, as gsm8k.py names it
    splits = (("train", rows[: synthetic.num_prompts]), ("test", rows[synthetic.num_prompts :]))
    train, val = ([{**r, "extra_info": {"split": s, "index": i}} for i, r in enumerate(part)] for s, part in splits)
    return train, val


def reward_source() -> str:
    """``reward.py``'s text: :func:`trainer.engine.data.score_response` and its helpers copied from their one
    implementation (source text, so they cannot drift), plus verl's ``compute_score`` signature."""
    from trainer.engine import data

    assert '"' not in data._NUMBER.pattern and not data._NUMBER.pattern.endswith("\\")  # fits in r"..."
    return "\n".join(
        [
            '"""Rule reward of the ppotune verl preset, for verl\'s reward.custom_reward_function.',
            "",
            "Generated by `ppotune make-preset verl`: a copy of trainer/engine/data.py's score_response, because verl",
            "loads this file by path in its own venv, where ppotune is not installed. Edit trainer/engine/data.py and",
            'regenerate rather than editing this file."""',
            "",
            "from __future__ import annotations",
            "",
            "import re",
            "",
            f'_NUMBER = re.compile(r"{data._NUMBER.pattern}")',
            "",
            "",
            inspect.getsource(data._last_number),
            "",
            inspect.getsource(data.score_response),
            "",
            f"def {REWARD_FN_NAME}(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:",
            '    """verl\'s custom reward signature; ``solution_str`` is the decoded response."""',
            "    return score_response(solution_str, ground_truth)",
            "",
        ]
    )


def _write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _check_shape(tiny: TinyModelConfig) -> None:
    """ValueError naming the option, for shapes Qwen2 cannot build."""
    for option, value in (
        ("--hidden-size", tiny.hidden_size),
        ("--layers", tiny.num_hidden_layers),
        ("--heads", tiny.num_attention_heads),
        ("--kv-heads", tiny.num_key_value_heads),
        ("--intermediate", tiny.intermediate_size),
    ):
        if value < 1:
            raise ValueError(f"{option}: must be >= 1, got {value}")
    if tiny.hidden_size % tiny.num_attention_heads:
        raise ValueError(f"--heads: {tiny.num_attention_heads} does not divide --hidden-size {tiny.hidden_size}")
    if tiny.num_attention_heads % tiny.num_key_value_heads:
        raise ValueError(f"--kv-heads: {tiny.num_key_value_heads} does not divide --heads {tiny.num_attention_heads}")
    if (tiny.hidden_size // tiny.num_attention_heads) % 2:
        raise ValueError(f"--heads: head size {tiny.hidden_size // tiny.num_attention_heads} must be even (RoPE)")


def _preset_overrides(out: Path, *, max_prompt_length: int, max_response_length: int) -> list[str]:
    """The verl Hydra overrides that point verl at the preset in ``out`` and size its job for one CPU rank."""
    model_dir, data_dir = out / "model", out / "data"
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"critic.model.path={model_dir}",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        f"reward.custom_reward_function.path={out / 'reward.py'}",
        f"reward.custom_reward_function.name={REWARD_FN_NAME}",
        # a CPU-sized PPO job on one rank (verl's defaults are sized for a GPU node: 1024 prompts a step)
        "algorithm.adv_estimator=gae",
        "data.train_batch_size=8",
        "data.dataloader_num_workers=0",  # loaders take the cores: docs/decisions.md#verl-preset-loaders
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "critic.ppo_mini_batch_size=4",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
    ]


def make_verl_preset(
    out_dir: str | Path,
    *,
    tiny: TinyModelConfig | None = None,
    synthetic: SyntheticDataConfig | None = None,
    num_val_prompts: int = 32,
    max_response_length: int = DataConfig.max_response_length,
    force: bool = False,
) -> list[str]:
    """Write the verl preset into ``out_dir`` and return its overrides (also in ``preset.yaml``).

    Raises ValueError naming the option for bad input (a non-empty ``out_dir`` without ``force``).
    """
    import yaml

    tiny = tiny or TinyModelConfig()
    synthetic = synthetic or SyntheticDataConfig(num_prompts=256)
    _check_shape(tiny)
    counts = {"--num-prompts": synthetic.num_prompts, "--num-val-prompts": num_val_prompts}
    for option, value in {**counts, "--max-response-length": max_response_length}.items():
        if value < 1:
            raise ValueError(f"{option}: must be >= 1, got {value}")
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"DIR: {out} is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"DIR: {out} is not empty (pass --force to write into it)")

    tokenizer = build_byte_tokenizer()
    train, val = verl_rows(synthetic=synthetic, num_val_prompts=num_val_prompts)
    # data.max_prompt_length fits the longest prompt as verl tokenizes it (chat template, generation prompt),
    # so verl's filter_overlong_prompts drops nothing and no truncation happens.
    longest = max(
        len(tokenizer(text, add_special_tokens=False)["input_ids"])
        for text in (
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in train + val
        )
    )
    max_prompt_length = -(-longest // _LENGTH_ROUND) * _LENGTH_ROUND
    model = build_model(
        tokenizer, tiny=tiny, max_positions=max_prompt_length + max_response_length, seed=synthetic.seed
    )

    model_dir, data_dir = out / "model", out / "data"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    _write_parquet(train, data_dir / "train.parquet")
    _write_parquet(val, data_dir / "val.parquet")
    (out / "reward.py").write_text(reward_source())

    overrides = _preset_overrides(out, max_prompt_length=max_prompt_length, max_response_length=max_response_length)
    header = (
        "# verl Hydra overrides that point verl at this preset (written by `ppotune make-preset verl`).\n"
        f"# model: Qwen2 {tiny.num_hidden_layers} layers x {tiny.hidden_size}, byte-level tokenizer, random init "
        f"(seed {synthetic.seed}); data: {len(train)} train / {len(val)} val arithmetic prompts.\n"
    )
    (out / "preset.yaml").write_text(header + yaml.safe_dump({"overrides": overrides}, sort_keys=False))
    return overrides
