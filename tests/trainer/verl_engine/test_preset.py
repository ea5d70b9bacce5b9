"""``ppotune make-preset verl --out DIR``: built offline, read back by transformers here and by verl in its own venv."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from trainer.config import SyntheticDataConfig
from trainer.engine.data import score_response, synthetic_rows

REPO = Path(__file__).resolve().parents[3]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
VERL_STATUS = REPO / ".test_deps" / "verl-venv.status"
CHECK_IN_VERL = Path(__file__).resolve().parents[1] / "verl_preset_check.py"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NUM_PROMPTS, NUM_VAL, SEED = 64, 8, 3


def _offline_env() -> dict:
    """No hub, no network: offline flags and a proxy that refuses every connection."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.update({k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")})
    return env


def _make_preset(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tuner.cli", "make-preset", *args],
        cwd=REPO,
        env=_offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("preset") / "verl"
    r = _make_preset("verl", "--out", str(out), "--num-prompts", str(NUM_PROMPTS), "--num-val-prompts", str(NUM_VAL))
    assert r.returncode == 0, r.stderr
    assert f"wrote the verl preset to {out}" in r.stdout
    return out


@pytest.fixture(scope="module")
def overrides(preset) -> dict[str, str]:
    listed = yaml.safe_load((preset / "preset.yaml").read_text())["overrides"]
    return dict(o.split("=", 1) for o in listed)


def test_files_and_overrides(preset, overrides):
    model = preset / "model"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (model / name).is_file(), name
    assert overrides == {
        "actor_rollout_ref.model.path": str(model),
        "critic.model.path": str(model),
        "data.train_files": str(preset / "data" / "train.parquet"),
        "data.val_files": str(preset / "data" / "val.parquet"),
        "data.max_prompt_length": overrides["data.max_prompt_length"],
        "data.max_response_length": "32",
        "reward.custom_reward_function.path": str(preset / "reward.py"),
        "reward.custom_reward_function.name": "compute_score",
        # a CPU-sized job on one rank: per-GPU mini-batch 4 x n 1 / 1 = 4, divided by micro-batch 2
        "algorithm.adv_estimator": "gae",
        "data.train_batch_size": "8",
        "data.dataloader_num_workers": "0",  # no loader processes taking the 2 cores the steps run on
        "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "2",
        "critic.ppo_mini_batch_size": "4",
        "critic.ppo_micro_batch_size_per_gpu": "2",
        "trainer.n_gpus_per_node": "1",
        "trainer.nnodes": "1",
    }
    assert int(overrides["data.max_prompt_length"]) % 8 == 0


def test_byte_level_qwen2_tokenizer(preset):
    from transformers import AutoTokenizer

    assert json.loads((preset / "model" / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    model = json.loads((preset / "model" / "tokenizer.json").read_text())["model"]
    assert model["type"] == "BPE" and model["merges"] == []
    tok = AutoTokenizer.from_pretrained(preset / "model", local_files_only=True)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert len(tok) == 256 + len(SPECIALS)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIALS] == [256, 257, 258]
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.encode("\n", add_special_tokens=False) == [10]  # one token: verl checks this for Qwen
    for text in ["12+345=", "héllo wörld 世界 🙂\n\ttab  two spaces\r\n", "", "\x00\x7f"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))  # a token is a byte, the id is its value
        assert tok.decode(ids) == text
    ids = tok.encode("1<|im_end|>2", add_special_tokens=False)
    assert ids == [49, 258, 50] and tok.decode(ids, skip_special_tokens=True) == "12"


def test_chat_template(preset, overrides):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(preset / "model", local_files_only=True)
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    # every prompt of the preset fits data.max_prompt_length, so verl filters and truncates nothing
    rows = pd.read_parquet(preset / "data" / "train.parquet").to_dict("records")
    rows += pd.read_parquet(preset / "data" / "val.parquet").to_dict("records")
    lengths = [
        len(tok(tok.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False))["input_ids"])
        for r in rows
    ]
    assert max(lengths) <= int(overrides["data.max_prompt_length"]) < max(lengths) + 8


def test_model_loads_generates_and_serves_as_critic(preset):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(preset / "model", local_files_only=True)
    actor = AutoModelForCausalLM.from_pretrained(preset / "model", local_files_only=True)
    assert actor.config.model_type == "qwen2" and actor.config.vocab_size == 264  # 259 rounded up to 8
    assert (actor.config.hidden_size, actor.config.num_hidden_layers) == (64, 2)
    assert actor.generation_config.eos_token_id == [258, 256] and actor.generation_config.pad_token_id == 256
    enc = tok("<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n", return_tensors="pt")
    out = actor.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 5)
    assert int(out.max()) < actor.config.vocab_size
    critic = AutoModelForTokenClassification.from_pretrained(preset / "model", num_labels=1, local_files_only=True)
    with torch.no_grad():
        values = critic(**enc).logits
    assert values.shape == (1, enc["input_ids"].shape[1], 1) and torch.isfinite(values).all()
    # the critic's backbone is the actor's: verl initialises both from the same checkpoint
    assert torch.equal(critic.model.embed_tokens.weight, actor.model.embed_tokens.weight)


def test_parquet_is_the_synthetic_task_in_verl_format(preset):
    train = pd.read_parquet(preset / "data" / "train.parquet").to_dict("records")
    val = pd.read_parquet(preset / "data" / "val.parquet").to_dict("records")
    assert (len(train), len(val)) == (NUM_PROMPTS, NUM_VAL)
    syn = SyntheticDataConfig()
    expected = synthetic_rows(
        num_prompts=NUM_PROMPTS + NUM_VAL,
        min_terms=syn.min_terms,
        max_terms=syn.max_terms,
        length_alpha=syn.length_alpha,
        seed=syn.seed,
    )
    for split, rows, want in (("train", train, expected[:NUM_PROMPTS]), ("test", val, expected[NUM_PROMPTS:])):
        for i, (row, w) in enumerate(zip(rows, want)):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert [dict(m) for m in row["prompt"]] == w["prompt"]
            assert dict(row["reward_model"]) == w["reward_model"] and w["reward_model"]["style"] == "rule"
            assert (row["data_source"], row["ability"]) == (w["data_source"], w["ability"])
            assert dict(row["extra_info"]) == {"split": split, "index": i}
    # Pareto-skewed lengths: the longest prompt is well above the typical one (dynamic batching has work to do)
    lengths = sorted(len(r["prompt"][0]["content"]) for r in train)
    assert lengths[-1] >= 2 * lengths[len(lengths) // 2]


def test_reward_file_is_score_response(preset):
    path = preset / "reward.py"
    imported = {
        a.name if isinstance(n, ast.Import) else n.module
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in getattr(n, "names", [])
    }
    assert imported <= {"re", "__future__"}  # standalone: verl loads it in a venv without ppotune
    spec = importlib.util.spec_from_file_location("preset_reward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = [("3", "3"), (" 3<|im_end|>", "3"), ("1,234 is it", "1234"), ("12", "#### 12"), ("4", "3"), ("x3", "3")]
    cases += [("", "0"), ("-5", "-5"), ("3.5", "3.5"), ("007", "7")]
    for solution, truth in cases:
        got = mod.compute_score("ppotune/synthetic_add", solution, truth, extra_info={"index": 0})
        assert got == score_response(solution, truth), (solution, truth)
    assert mod.compute_score("d", "42", "42") == 1.0 and mod.compute_score("d", "41", "42") == 0.1


def test_same_seed_same_preset_and_force(preset, tmp_path):
    """Re-running with the same arguments rewrites identical data and weights (--force into a non-empty DIR)."""
    from safetensors.torch import load_file

    from trainer.verl_engine.preset import make_verl_preset

    out = tmp_path / "again"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    with pytest.raises(ValueError, match="^DIR: .* is not empty"):
        make_verl_preset(out, synthetic=SyntheticDataConfig(num_prompts=NUM_PROMPTS), num_val_prompts=NUM_VAL)
    make_verl_preset(out, synthetic=SyntheticDataConfig(num_prompts=NUM_PROMPTS), num_val_prompts=NUM_VAL, force=True)
    assert (out / "keep.txt").read_text() == "user file"
    for name in ("data/train.parquet", "data/val.parquet", "reward.py"):
        assert (out / name).read_bytes() == (preset / name).read_bytes(), name
    a, b = load_file(out / "model" / "model.safetensors"), load_file(preset / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    make_verl_preset(tmp_path / "seed", synthetic=SyntheticDataConfig(num_prompts=NUM_PROMPTS, seed=SEED))
    c = load_file(tmp_path / "seed" / "model" / "model.safetensors")
    assert not (c["model.embed_tokens.weight"] == a["model.embed_tokens.weight"]).all()
    assert (tmp_path / "seed" / "data" / "train.parquet").read_bytes() != (out / "data" / "train.parquet").read_bytes()


@pytest.mark.parametrize(
    "args, where",
    [
        (["vllm", "--out", "{dir}"], "argument preset: invalid choice: 'vllm'"),
        (["verl", "--out", "{dir}/nonempty"], "DIR: "),
        (["verl", "--out", "{dir}/x", "--heads", "3"], "--heads: 3 does not divide --hidden-size 64"),
        (["verl", "--out", "{dir}/x", "--kv-heads", "3"], "--kv-heads: 3 does not divide --heads 2"),
        (["verl", "--out", "{dir}/x", "--num-prompts", "0"], "--num-prompts: must be >= 1"),
    ],
)
def test_bad_input_exits_2_naming_the_argument(tmp_path, args, where):
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "f").write_text("")
    r = _make_preset(*(a.format(dir=tmp_path) for a in args))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppotune make-preset: error: ") and where in lines[0], r.stderr
    assert not (tmp_path / "x").exists()


def test_verl_reads_the_preset(preset, overrides, tmp_path):
    """verl 0.9.1 in its own venv reads the preset as main_ppo does: config, tokenizer, datasets, reward, model."""
    if not VERL_PYTHON.exists():
        reason = VERL_STATUS.read_text().strip() if VERL_STATUS.exists() else f"{VERL_PYTHON} does not exist"
        pytest.skip(f"verl venv not installed (.venv-verl): {reason}")
    env = {**_offline_env(), "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "PYTHONPATH": ""}
    r = subprocess.run(
        [str(VERL_PYTHON), str(CHECK_IN_VERL), str(preset)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-4000:]
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    assert facts["verl"] == "0.9.1" and facts["tokenizer_class"] == "Qwen2Tokenizer"
    assert facts["newline_ids"] == [10] and facts["roundtrip"]
    assert (facts["train_len"], facts["val_len"]) == (NUM_PROMPTS, NUM_VAL)  # nothing filtered as overlong
    assert facts["longest_prompt"] <= facts["max_prompt_length"] == int(overrides["data.max_prompt_length"])
    assert {"raw_prompt", "reward_model", "data_source", "extra_info", "index"} <= set(facts["batch_keys"])
    assert (facts["reward_right"], facts["reward_wrong"]) == (1.0, 0.0)
    assert facts["generated_new_tokens"] == 4 and facts["critic_values_shape"][-1] == 1
    assert facts["vocab_size"] >= facts["tokenizer_len"] == 259


def test_cli_parser_stays_torch_free():
    """tuner/cli.py names the module only; parsing make-preset's arguments imports no torch."""
    code = (
        "import sys\nfrom tuner.cli import build_parser\n"
        "build_parser(only='make-preset').parse_args(['make-preset', 'verl', 'd'])\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\nprint('clean')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_offline_env(), capture_output=True, text=True)
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr
