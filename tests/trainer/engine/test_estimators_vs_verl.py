"""ppotune's advantage estimators, KL estimators and loss aggregation against verl 0.9.1's own functions
(``verl.trainer.ppo.core_algos``, run in verl's venv on the same inputs): the same numbers."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from trainer.config.rules import ADV_ESTIMATORS
from trainer.engine import core, estimators

VERL_PY = Path(__file__).resolve().parents[3] / ".venv-verl" / "bin" / "python"

# Runs in verl's venv: every estimator on the inputs of argv[1], the results printed as JSON.
_VERL = r"""
import json, sys
import numpy as np, torch
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos as c
inp = json.loads(open(sys.argv[1]).read())
rewards, mask = torch.tensor(inp["rewards"]), torch.tensor(inp["mask"])
index = np.array(inp["index"], dtype=object)
cfg = OmegaConf.create({"gamma": inp["gamma"], "norm_adv_by_std_in_grpo": True})
out = {}
for name in inp["outcome"]:
    fn = c.get_adv_estimator_fn(name)
    kw = {"norm_adv_by_std_in_grpo": inp["norm"]} if name in ("grpo", "grpo_vectorized") else {}
    if name == "grpo_passk":
        kw["config"] = OmegaConf.create({"norm_adv_by_std_in_grpo": inp["norm"]})
    out[name] = fn(token_level_rewards=rewards.clone(), response_mask=mask, index=index, **kw)[0].tolist()
out["reinforce_plus_plus"] = c.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=cfg)[0].tolist()
adv, ret = c.compute_remax_outcome_advantage(rewards, torch.tensor(inp["baselines"]), mask)
out["remax"], out["remax_returns"] = adv.tolist(), ret.tolist()
lp, ref = torch.tensor(inp["logp"], requires_grad=True), torch.tensor(inp["ref"])
for name in inp["kl"]:
    v = c.kl_penalty(lp, ref, name)
    (g,) = torch.autograd.grad(v.sum(), lp)
    out["kl_" + name] = [v.tolist(), g.tolist()]
loss = torch.tensor(inp["logp"])
for mode in inp["modes"]:
    out["agg_" + mode] = c.agg_loss(loss, mask, mode, loss_scale_factor=inp["scale"]).item()
print(json.dumps(out))
"""
#: the outcome estimators (one score per response, grouped by prompt): every estimator ppotune runs but GAE (values),
#: reinforce++ (discounted per token, checked on its own below) and remax (a greedy baseline, below)
OUTCOME = [e for e in ADV_ESTIMATORS if e not in ("gae", "reinforce_plus_plus", "remax")]
KL = ["kl", "abs", "mse", "low_var_kl", "k1+", "k3+", "low_var_kl+"]
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    if not VERL_PY.is_file():
        pytest.skip("verl venv not installed (.venv-verl)")
    g = torch.Generator().manual_seed(7)
    n, width = 14, 6  # 4 prompts x 3 responses and one prompt with 2; scores with ties and zeros
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    scores = torch.randint(0, 3, (n,), generator=g).float() / 2
    rewards = torch.zeros(n, width)
    rewards[torch.arange(n), lengths - 1] = scores  # an outcome reward on the last token
    rewards += 0.1 * torch.randn(n, width, generator=g) * mask  # and a per-token part (a KL penalty)
    inp = {
        "rewards": rewards.tolist(),
        "mask": mask.tolist(),
        "index": [f"uid-{i}" for i in index],
        "gamma": 0.9,
        "norm": True,
        "outcome": OUTCOME,
        "baselines": torch.rand(n, generator=g).tolist(),
        "logp": (-torch.rand(n, width, generator=g) * 3).tolist(),
        "ref": (-torch.rand(n, width, generator=g) * 3).tolist(),
        "kl": KL,
        "modes": MODES,
        "scale": 4,
    }
    path = tmp_path_factory.mktemp("verl_estimators") / "in.json"
    path.write_text(json.dumps(inp))
    r = subprocess.run([str(VERL_PY), "-c", _VERL, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return inp, json.loads(r.stdout.strip().splitlines()[-1]), torch.tensor(index)


def _ours(name: str, rewards, mask, index):
    est = estimators.ESTIMATORS[name]
    per_response = est.fn(rewards.sum(-1), index, mask.sum(-1), True)
    adv = estimators.broadcast(per_response, mask)
    if est.whiten:
        mean, var = core.moments_to_mean_var(*core.masked_moments(adv, mask))
        adv = core.whiten(adv, mask, mean=mean, var=var)
    return adv


@pytest.mark.parametrize("name", OUTCOME)
def test_outcome_estimators_match_verl(case, name):
    inp, verl, index = case
    rewards, mask = torch.tensor(inp["rewards"]), torch.tensor(inp["mask"])
    torch.testing.assert_close(_ours(name, rewards, mask, index).float(), torch.tensor(verl[name]), atol=1e-5, rtol=0)


def test_token_level_estimators_match_verl(case):
    inp, verl, _ = case
    rewards, mask = torch.tensor(inp["rewards"]), torch.tensor(inp["mask"])
    returns = estimators.reinforce_plus_plus_returns(rewards, mask, gamma=inp["gamma"])
    mean, var = core.moments_to_mean_var(*core.masked_moments(returns, mask))
    adv = core.whiten(returns, mask, mean=mean, var=var)
    torch.testing.assert_close(adv.float(), torch.tensor(verl["reinforce_plus_plus"]), atol=1e-5, rtol=0)
    adv, ret = estimators.remax_advantage_return(rewards, torch.tensor(inp["baselines"]), mask)
    torch.testing.assert_close(adv, torch.tensor(verl["remax"]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(verl["remax_returns"]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", KL)
def test_kl_estimators_and_their_gradients_match_verl(case, name):
    inp, verl, _ = case
    lp = torch.tensor(inp["logp"], requires_grad=True)
    value = core.kl_penalty(lp, torch.tensor(inp["ref"]), name)
    (grad,) = torch.autograd.grad(value.sum(), lp)
    torch.testing.assert_close(value.detach(), torch.tensor(verl["kl_" + name][0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, torch.tensor(verl["kl_" + name][1]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_loss_aggregation_matches_verl(case, mode):
    """verl on one rank without global info: the batch's own tokens and sequences are the totals."""
    inp, verl, _ = case
    loss, mask = torch.tensor(inp["logp"]), torch.tensor(inp["mask"])
    ours = core.agg_loss(
        loss,
        mask,
        loss_agg_mode=mode,
        global_num_tokens=mask.sum(),
        global_num_seqs=(mask.sum(-1) > 0).sum(),
        loss_scale_factor=inp["scale"],
    )
    assert abs(ours.item() - verl["agg_" + mode]) < 1e-5
