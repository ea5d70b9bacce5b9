"""Prompts: verl parquet, or the embedded synthetic arithmetic task; and the rule-based reward.

Both sources produce rows in verl's format (``prompt`` = chat messages,
``reward_model.ground_truth``), so one path tokenizes them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from trainer.datafiles import REWARD_COLUMN, missing_columns, required_columns, split_files

__all__ = [
    "PromptDataset",
    "synthetic_rows",
    "read_parquet_rows",
    "load_rows",
    "score_response",
    "PromptLoader",
    "extend_prompt",
]


def synthetic_rows(
    *, num_prompts: int, min_terms: int, max_terms: int, length_alpha: float, seed: int, max_chars: int = 10**9
) -> list[dict]:
    """Sums of 1-3 digit numbers; the number of terms is Pareto-distributed (heavy tail of long prompts),
    so sequence lengths are skewed and dynamic batching has something to gain."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_prompts):
        extra = int(rng.paretovariate(length_alpha)) - 1  # 0 most of the time, occasionally large
        n_terms = min(max_terms, min_terms + extra)
        terms = [rng.randint(0, 10 ** rng.randint(1, 3) - 1) for _ in range(n_terms)]
        question = "+".join(map(str, terms)) + "="
        while len(question) > max_chars and len(terms) > 1:  # fit data.max_prompt_length
            terms.pop()
            question = "+".join(map(str, terms)) + "="
        rows.append(
            {
                "data_source": "ppotune/synthetic_add",
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(sum(terms))},
                "extra_info": {"index": i},
            }
        )
    return rows


def read_parquet_rows(paths: str, prompt_key: str = "prompt") -> list[dict]:
    """verl's RL parquet: a chat-message column (``prompt_key``) and ``reward_model.ground_truth``."""
    import pandas as pd

    rows: list[dict] = []
    for path in split_files(paths):
        df = pd.read_parquet(path)
        missing = missing_columns(df.columns, prompt_key)
        if missing:
            need = " and ".join(required_columns(prompt_key))
            raise ValueError(f"{path}: data.train_files: missing column {missing[0]!r} (verl format needs {need})")
        for rec in df.to_dict("records"):
            messages = [dict(m) for m in rec[prompt_key]]
            rows.append({**rec, "prompt": messages, REWARD_COLUMN: dict(rec[REWARD_COLUMN])})
    if not rows:
        raise ValueError(f"{paths}: data.train_files: no rows")
    return rows


# Tokens the chat template adds around a user message with the embedded tokenizer.
_TEMPLATE_OVERHEAD = 19


def load_rows(data_cfg, synthetic_cfg) -> list[dict]:
    if data_cfg.train_files:
        return read_parquet_rows(data_cfg.train_files, data_cfg.prompt_key)
    s = synthetic_cfg
    return synthetic_rows(
        num_prompts=s.num_prompts,
        min_terms=s.min_terms,
        max_terms=s.max_terms,
        length_alpha=s.length_alpha,
        seed=s.seed,
        max_chars=max(4, data_cfg.max_prompt_length - _TEMPLATE_OVERHEAD),
    )


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def score_response(response: str, ground_truth: str) -> float:
    """Rule-based reward: 1.0 if the first number of the response equals the answer
    (the last number of ``ground_truth``, which also reads GSM8K's ``#### 42``), 0.1 if it
    at least starts with a digit (a format reward so a random policy sees a signal), else 0."""
    answer = _last_number(str(ground_truth))
    first = _NUMBER.match(response.strip())
    if first is not None and answer is not None and first.group(0).replace(",", "") == answer:
        return 1.0
    return 0.1 if first is not None else 0.0


@dataclass
class PromptDataset:
    """Tokenized prompts (chat template applied), each <= max_prompt_length tokens."""

    input_ids: list[list[int]]
    ground_truths: list[str]

    @classmethod
    def build(
        cls,
        rows: list[dict],
        tokenizer,
        *,
        max_prompt_length: int,
        truncation: str,
        prompt_key: str = "prompt",
        source: str = "data",
    ) -> "PromptDataset":
        ids, truths = [], []
        for i, row in enumerate(rows):
            text = tokenizer.apply_chat_template(
                row[prompt_key] if prompt_key in row else row["prompt"], add_generation_prompt=True, tokenize=False
            )
            toks = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(toks) > max_prompt_length:
                if truncation == "error":
                    raise ValueError(
                        f"{source}: data.max_prompt_length: prompt {i} has {len(toks)} tokens > {max_prompt_length} "
                        "(raise it, or set data.truncation=left|right)"
                    )
                toks = toks[-max_prompt_length:] if truncation == "left" else toks[:max_prompt_length]
            ids.append(toks)
            truths.append(str(row["reward_model"]["ground_truth"]))
        return cls(ids, truths)

    def __len__(self) -> int:
        return len(self.input_ids)

    def at_length(self, length: int) -> "PromptDataset":
        """Every prompt exactly ``length`` real tokens (:func:`extend_prompt`): the worst-case probe's prompts."""
        return PromptDataset([extend_prompt(ids, length) for ids in self.input_ids], list(self.ground_truths))


def extend_prompt(ids: list[int], length: int) -> list[int]:
    """A tokenized prompt made exactly ``length`` tokens from its own tokens: repeated, cut from the left.

    The end (the chat template's generation prompt) stays where generation starts; the added tokens are
    real text of the data set, never padding (remove-padding drops pad tokens, which would understate the
    memory of a long prompt). Works on token ids, after the chat template and truncation, so neither can
    shorten the result. A prompt already ``length`` or longer is cut from the left to ``length``.
    """
    if length <= 0:
        raise ValueError(f"length must be > 0, got {length}")
    if not ids:
        raise ValueError("an empty prompt has no tokens to extend")
    repeats = -(-length // len(ids))  # ceil
    return (list(ids) * repeats)[-length:]


class PromptLoader:
    """Endless, seeded, epoch-shuffled global batches of prompt indices (same on every rank)."""

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < batch_size:
            raise ValueError(f"data.train_batch_size: {batch_size} is larger than the data set ({n} prompts)")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.pos, self.order = 0, 0, self._order(0)

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self) -> list[int]:
        if self.pos + self.batch_size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = self._order(self.epoch)
        out = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return out


def left_pad(seqs: list[list[int]], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids (B, length), attention_mask (B, length); prompts right-aligned."""
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s) :] = 1
    return ids, mask
