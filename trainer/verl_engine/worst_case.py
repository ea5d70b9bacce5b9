"""The worst-case probe through verl (``ppotune.worst_case: true`` in a verl run file): one step of verl itself
with every prompt ``data.max_prompt_length`` real tokens and every response ``data.max_response_length`` tokens.

verl has no worst-case mode, so the run gets worst-case inputs instead of a switch:

* a generated parquet (:func:`write_worst_case_data`, run in the user's verl environment: its Hydra config, its
  tokenizer, its chat template): the first ``data.train_batch_size`` rows of the first train file, each
  prompt's last message its own text repeated until the templated prompt holds at least ``max_prompt_length``
  tokens. verl's agent loop cuts a longer prompt from the left to ``rollout.prompt_length``
  (= ``data.max_prompt_length``), so every prompt is exactly that many real tokens of the data set, ending with
  the chat template's generation prompt — what :func:`trainer.engine.data.extend_prompt` does for our engine;
* ``actor_rollout_ref.rollout.ignore_eos=True`` (verl 0.9.1's rollout key; its vLLM server and our CPU shim's HF
  rollout honour it): every response runs to ``max_response_length``;
* ``data.filter_overlong_prompts=False``: verl would otherwise drop every one of those prompts.

Torch-free: the generation runs as a subprocess of the verl interpreter.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from trainer.config import ConfigError

__all__ = ["WORST_CASE_KEYS", "write_worst_case_data", "worst_case_overrides"]

#: what a worst-case probe sets on top of the run's overrides (``++``: whether or not verl's config has the key)
WORST_CASE_KEYS = (
    "data.train_files",
    "data.filter_overlong_prompts",
    "data.shuffle",
    "actor_rollout_ref.rollout.ignore_eos",
)

_MARGIN = 8  # tokens beyond max_prompt_length: a template that counts a few tokens differently still overshoots

_SCRIPT = r"""
import importlib.util, json, os, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
import pyarrow as pa, pyarrow.parquet as pq
from transformers import AutoTokenizer

a = json.loads(sys.argv[1])
root = os.path.dirname(importlib.util.find_spec("verl").origin)
with initialize_config_dir(config_dir=os.path.join(root, "trainer", "config"), version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=a["overrides"])
data, model = cfg.data, cfg.actor_rollout_ref.model
files = data.train_files
files = [files] if isinstance(files, str) else list(files)
length, rows_needed, key = int(data.max_prompt_length) + a["margin"], int(data.train_batch_size), data.prompt_key
trust = bool(model.get("trust_remote_code", False) or data.get("trust_remote_code", False))
tok = AutoTokenizer.from_pretrained(model.get("tokenizer_path") or model.path, trust_remote_code=trust)
kwargs = data.get("apply_chat_template_kwargs")
kwargs = OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs or {})
table = pq.read_table(files[0])
source = table.to_pylist()
if not source:
    sys.exit(f"data.train_files: {files[0]} has no rows")
rows = [dict(source[i % len(source)]) for i in range(rows_needed)]


def count(messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    return len(ids["input_ids"] if isinstance(ids, dict) else ids)


for row in rows:
    messages = [dict(m) for m in row[key]]
    i = max(j for j, m in enumerate(messages) if isinstance(m.get("content"), str))
    text, k = messages[i]["content"] or " ", 1
    while True:
        messages[i]["content"] = "\n".join([text] * k)
        n = count(messages)
        if n >= length:
            break
        k = max(k + 1, k * length // max(n, 1))
    row[key] = messages
pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), a["out"])
print(json.dumps({"rows": len(rows), "source": files[0]}))
"""


def write_worst_case_data(python: str, overrides: list[str], out: Path, *, source: str | None = None) -> Path:
    """The worst-case prompts of the run ``overrides`` describe, written to ``out`` (a parquet in verl's RL
    format) by ``python`` (the verl environment). Raises ConfigError (naming ``data.train_files``) when it fails."""
    args = json.dumps({"overrides": list(overrides), "out": str(out), "margin": _MARGIN})
    try:
        r = subprocess.run([python, "-c", _SCRIPT, args], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError("data.train_files", f"the worst-case prompts could not be made: {e}", source=source) from None
    if r.returncode != 0 or not out.is_file():
        last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise ConfigError("data.train_files", f"the worst-case prompts could not be made: {last}", source=source)
    return out


def worst_case_overrides(data_file: Path) -> list[str]:
    """The overrides that make a verl run its worst case, given the generated prompts (:data:`WORST_CASE_KEYS`)."""
    return [
        f"++data.train_files={data_file}",
        "++data.filter_overlong_prompts=False",
        "++data.shuffle=False",
        "++actor_rollout_ref.rollout.ignore_eos=True",
    ]
