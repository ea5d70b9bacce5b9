"""The passes a PPO step runs on one role (torch): the forward passes (:func:`forward_response` on one
micro-batch; :func:`compute_log_probs`, :func:`compute_old_log_probs`, :func:`compute_values` over a batch) and
the updates (:func:`forward_backward` of one mini-batch, :func:`optimizer_step`, :func:`update_actor`,
:func:`update_critic`). trainer/engine/step.py runs them as the phases of a step.

The per-GPU knobs enter only through :class:`~trainer.engine.roles.MicroBatching`, ``rmpad`` and the sharding:
losses are token means over the GLOBAL mini-batch (the token count is all-reduced once per mini-batch), so an
update does not depend on how the batch is split across micro-batches or ranks. The hot loop stays on the
device: a pass reads its batch's masks to the host once and builds every micro-batch's indices there
(trainer/engine/batching.py), no micro-batch waits for the host, and an update's statistics are read once, at
its end (verl's actor reads a loss value per micro-batch).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from trainer.engine import core
from trainer.engine.attention import varlen_kwargs
from trainer.engine.batching import (
    HostMasks,
    MicroBatchLayout,
    all_ranks_max,
    build_layouts,
    dynamic_micro_batches,
    fixed_micro_batches,
    host_masks,
    pad_tail,
    scatter_rows,
)
from trainer.engine.logits import token_log_probs
from trainer.engine.offload import activation_offload_context
from trainer.engine.parallel import clip_grad_norm, compute_autocast, gradient_sync
from trainer.engine.roles import ActorLoss, MicroBatching, Trainee, resident

__all__ = [
    "forward_response",
    "plan_micro_batches",
    "compute_log_probs",
    "compute_old_log_probs",
    "compute_values",
    "all_reduce_sum",
    "forward_backward",
    "optimizer_step",
    "actor_loss",
    "Loss",
    "update_actor",
    "update_critic",
]


# --------------------------------------------------------------------------- forward passes
def forward_response(
    module: torch.nn.Module,
    mb: dict,
    *,
    kind: str,
    rmpad: bool,
    prompt_width: int,
    temperature: float = 1.0,
    entropy_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    pad_to_multiple: Optional[int] = None,
    layout: Optional[MicroBatchLayout] = None,
) -> dict:
    """Per-response-token outputs of one micro-batch: ``log_prob`` (+ ``entropy`` with an ``entropy_fn``)
    or ``values``, each (b, R).

    rmpad: the valid tokens of all rows are packed into one row (no pad token enters the forward),
    padded at the tail to a multiple of ``pad_to_multiple`` if given (verl's ``pad_to_length``), by the
    indices of ``layout`` (built on the host for the whole pass; without one they are built here, reading the
    masks to the host once).
    padded: rows keep the [left-padded prompt | right-padded response] layout.
    """
    ids, pos, resp = mb["input_ids"], mb["position_ids"], mb["responses"]
    R = resp.shape[1]
    if not rmpad:
        out = module(input_ids=ids, attention_mask=mb["attention_mask"], position_ids=pos, use_cache=False).logits
        if kind == "critic":
            rows = out[:, prompt_width - 1 : prompt_width - 1 + R]  # the outputs at the positions before each token
            return {"values": rows[..., 0].float() * mb["response_mask"]}
        b, width = out.shape[:2]
        # the rows of the flattened logits that predict each response token
        predictor = torch.arange(b, device=ids.device)[:, None] * width + torch.arange(R, device=ids.device)[None]
        predictor = (predictor + prompt_width - 1).reshape(-1)
        res = _token_outputs(out.reshape(b * width, -1), predictor, resp.reshape(-1), temperature, entropy_fn)
        return {k: v.view(b, R) * mb["response_mask"] for k, v in res.items()}
    if layout is None:
        groups = [list(range(ids.shape[0]))]
        (layout,) = build_layouts(host_masks(mb), groups, pad_to_multiple=pad_to_multiple, device=ids.device)
    packed_ids = ids.reshape(-1).index_select(0, layout.token_index).unsqueeze(0)
    packed_pos = pos.reshape(-1).index_select(0, layout.token_index).unsqueeze(0)
    packed_ids, packed_pos = pad_tail(packed_ids, packed_pos, layout.pad)
    # sequence boundaries for the attention layers: no T x T mask (trainer/engine/attention.py)
    varlen = varlen_kwargs(layout.seq_lens, layout.cu_seq_lens)
    # (T, V or 1); squeezed, not indexed: an index's backward would copy the logits' whole gradient into a new tensor
    out = module(input_ids=packed_ids, position_ids=packed_pos, use_cache=False, **varlen).logits.squeeze(0)
    shape = (resp.shape[0], R)
    if kind == "critic":
        values = out.index_select(0, layout.predictor)[:, 0].float()  # (N,): the value before each response token
        return {"values": scatter_rows(values, layout.response_index, shape)}
    labels = resp.reshape(-1).index_select(0, layout.response_index)
    res = _token_outputs(out, layout.predictor, labels, temperature, entropy_fn)
    return {k: scatter_rows(v, layout.response_index, shape) for k, v in res.items()}


def _token_outputs(
    logits: torch.Tensor,
    rows: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    entropy_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
) -> dict:
    """``log_prob`` (+ ``entropy``) (N,) of the ``rows`` of the (M, V) logits that predict ``labels``, with verl's
    GPU memory (trainer/engine/logits.py): the logits kept once in the compute dtype (divided by the temperature
    out of place, as verl does), fp32 work a chunk at a time, the log-prob's gradient written into the logits
    unless the entropy reads them in backward (verl's ``inplace_backward``)."""
    scaled = _scaled(logits, temperature)
    inplace = entropy_fn is None or not torch.is_grad_enabled()
    out = {"log_prob": token_log_probs(scaled, rows, labels, inplace_backward=inplace)}
    if entropy_fn is not None:
        out["entropy"] = entropy_fn(scaled, rows)
    return out


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits divided by the temperature; at temperature 1 the same tensor (verl skips the division there too)."""
    return logits if temperature == 1.0 else logits / temperature


#: what a forward reads of a micro-batch (packed; padded rows need the masks too)
FORWARD_KEYS = ("input_ids", "position_ids", "responses")
PADDED_KEYS = ("attention_mask", "response_mask")


class Totals(NamedTuple):
    """What a loss divides by, over the GLOBAL mini-batch (every micro-batch, every rank): its valid tokens
    (token-mean) and its sequences (verl's ``global_batch_size``, the seq-mean modes); 0-d fp64 tensors."""

    tokens: torch.Tensor
    seqs: torch.Tensor


class Loss(NamedTuple):
    """A role's loss on one micro-batch: ``fn(module, mb, totals, layout) -> (loss, [statistics])`` (``totals``:
    the whole mini-batch's :class:`Totals`), the statistics' ``names`` (in their order), and the batch entries
    (``keys``) a micro-batch of it reads."""

    fn: Callable
    names: list[str]
    keys: tuple[str, ...]


def _select(batch: dict, layout: MicroBatchLayout, keys: tuple[str, ...]) -> dict:
    """A micro-batch's rows of ``keys``: a view when its rows are consecutive, else one gather per entry."""
    if layout.span is not None:
        start, stop = layout.span
        return {k: batch[k][start:stop] for k in keys}
    return {k: batch[k].index_select(0, layout.rows) for k in keys}


def plan_micro_batches(
    masks: Optional[HostMasks], row_sets: list[list[int]], plan: MicroBatching, device: torch.device
) -> list[list[list[int]]]:
    """Each row set's micro-batches (lists of rows, in the order they run). With a token budget, verl 0.9.1's
    packing (trainer/packing.py): the ranks agree on the count (one collective for every row set of the pass, one
    more per repartition round) so every rank runs the same number of FSDP passes; the lengths come from the host
    masks, so only the agreed counts are read back."""
    if not plan.dynamic:
        return [
            [[rows[i] for i in c] for c in fixed_micro_batches(len(rows), plan.micro_batch_size)] for rows in row_sets
        ]
    lengths = [masks.lengths(rows) for rows in row_sets]
    packed = dynamic_micro_batches(lengths, plan.max_token_len, all_max=all_ranks_max(device))
    return [[[rows[i] for i in b] for b in bins] for rows, bins in zip(row_sets, packed)]


def _layouts(
    trainee: Trainee, batch: dict, row_sets: list[list[int]], plan: MicroBatching, device: torch.device
) -> list[list[MicroBatchLayout]]:
    """The layouts of every micro-batch of every row set of a pass, built once on the host: the masks read once
    (when packing or a token budget needs them), the indices moved to the device in one copy."""
    masks = host_masks(batch) if trainee.rmpad or plan.dynamic else None
    groups = plan_micro_batches(masks, row_sets, plan, device)
    flat = build_layouts(
        masks if trainee.rmpad else None,
        [g for gs in groups for g in gs],
        pad_to_multiple=trainee.pad_to_multiple,
        device=device,
    )
    out, start = [], 0
    for gs in groups:
        out.append(flat[start : start + len(gs)])
        start += len(gs)
    return out


def _forward_only(
    trainee: Trainee,
    batch: dict,
    plan: MicroBatching,
    *,
    kind: str,
    prompt_width: int,
    temperature: float,
    device: torch.device,
    entropy: bool = False,
) -> dict:
    keys = ["values"] if kind == "critic" else ["log_prob"] + (["entropy"] if entropy else [])
    n = batch["input_ids"].shape[0]
    out = {k: torch.zeros_like(batch["responses"], dtype=torch.float32) for k in keys}
    module = trainee.sharded.module
    (layouts,) = _layouts(trainee, batch, [list(range(n))], plan, device)
    with torch.no_grad(), resident(trainee, device), compute_autocast(trainee.sharded, device.type):
        for layout in layouts:
            # an empty micro-batch still runs (on row 0) so FSDP's collectives line up across ranks
            res = forward_response(
                module,
                _select(batch, layout, FORWARD_KEYS + (() if trainee.rmpad else PADDED_KEYS)),
                kind=kind,
                rmpad=trainee.rmpad,
                prompt_width=prompt_width,
                temperature=temperature,
                entropy_fn=trainee.sharded.entropy_fn if entropy else None,
                layout=layout,
            )
            if not layout.empty:
                for k in keys:
                    out[k].index_copy_(0, layout.rows, res[k])
    return out


def compute_log_probs(
    trainee: Trainee, batch: dict, plan: MicroBatching, *, prompt_width: int, temperature: float, device: torch.device
) -> torch.Tensor:
    """Per-token log-probs (B, R) of the responses (the reference model's, or the actor's)."""
    return _forward_only(
        trainee, batch, plan, kind="actor", prompt_width=prompt_width, temperature=temperature, device=device
    )["log_prob"]


def compute_old_log_probs(
    trainee: Trainee, batch: dict, plan: MicroBatching, *, prompt_width: int, temperature: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour policy's log-probs and, without autograd, its entropy (verl's old-log-prob pass
    computes the ``actor/entropy`` metric there, so the update need not unless entropy is in the loss)."""
    out = _forward_only(
        trainee,
        batch,
        plan,
        kind="actor",
        prompt_width=prompt_width,
        temperature=temperature,
        device=device,
        entropy=True,
    )
    return out["log_prob"], out["entropy"]


def compute_values(
    trainee: Trainee, batch: dict, plan: MicroBatching, *, prompt_width: int, device: torch.device
) -> torch.Tensor:
    return _forward_only(
        trainee, batch, plan, kind="critic", prompt_width=prompt_width, temperature=1.0, device=device
    )["values"]


# --------------------------------------------------------------------------- updates
def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def optimizer_step(trainee: Trainee, grad_clip: float, device: torch.device) -> torch.Tensor:
    """Clip, step (skipped on a non-finite norm, as verl does), zero the gradients; -> the norm, on the device.
    Reading whether the norm is finite is the one host wait of an optimizer step (verl's reads it twice)."""
    grad_norm = clip_grad_norm(trainee.sharded, grad_clip, device)
    if torch.isfinite(grad_norm):
        trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach()


def forward_backward(
    trainee: Trainee,
    batch: dict,
    rows: slice,
    layouts: list[MicroBatchLayout],
    loss: Loss,
    *,
    device: torch.device,
) -> torch.Tensor:
    """One mini-batch's gradient accumulation over its micro-batches (``layouts``): forward, loss, backward;
    -> the sums of the loss's statistics over the micro-batches, fp64 on the device (never read here: no host
    wait inside the loop). Losses are token means over the GLOBAL mini-batch ``rows``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = torch.stack(
        [
            batch["response_mask"][rows].sum().to(torch.float64),
            batch["response_mask"][rows].new_tensor(float(batch["response_mask"][rows].shape[0]), dtype=torch.float64),
        ]
    )
    reduced = all_reduce_sum(local)  # one collective for both totals
    totals = Totals(tokens=reduced[0].clamp(min=1.0), seqs=reduced[1].clamp(min=1.0))
    acc = torch.zeros(len(loss.names), dtype=torch.float64, device=device)
    module = trainee.sharded.module
    keys = loss.keys + (() if trainee.rmpad else PADDED_KEYS)
    for i, layout in enumerate(layouts):
        mb = _select(batch, layout, tuple(dict.fromkeys(keys)))
        sync = i == len(layouts) - 1 or not trainee.no_sync
        with gradient_sync(trainee.sharded, sync):
            offload = activation_offload_context(
                trainee.activation_offload, device, trainee.sharded, on_cpu=trainee.offload_on_cpu
            )
            with offload:
                with compute_autocast(trainee.sharded, device.type):
                    value, stats = loss.fn(module, mb, totals, layout)
            # FSDP averages gradients over ranks; x world makes the sum of token losses / global tokens exact.
            # An empty micro-batch (run on row 0 so the collectives line up) has weight 0.
            (value * (0.0 if layout.empty else float(world))).backward()
        if not layout.empty:
            acc += torch.stack([s.detach() for s in stats]).to(torch.float64)
    return acc


def _minibatch_loop(
    trainee: Trainee,
    batch: dict,
    *,
    mini_per_gpu: int,
    epochs: int,
    plan: MicroBatching,
    loss: Loss,
    grad_clip: float,
    device: torch.device,
) -> dict:
    """epochs x mini-batches x micro-batches, gradient accumulation; returns mean stats over mini-batches.
    Every index is built once for the whole update; its statistics are read once, at the end."""
    n = batch["input_ids"].shape[0]
    minis = [slice(s, min(s + mini_per_gpu, n)) for s in range(0, n, mini_per_gpu)]
    layouts = _layouts(trainee, batch, [list(range(n))[m] for m in minis], plan, device)
    stats = torch.zeros(len(loss.names), dtype=torch.float64, device=device)
    norms = torch.zeros((), dtype=torch.float64, device=device)
    with resident(trainee, device, update=True):
        for _ in range(epochs):
            for rows, mini_layouts in zip(minis, layouts):
                stats += forward_backward(trainee, batch, rows, mini_layouts, loss, device=device)
                norms += optimizer_step(trainee, grad_clip, device).to(torch.float64)
    num_updates = max(epochs * len(minis), 1)
    # one collective and one host read for the whole update (the statistics are sums over every rank's tokens)
    values = torch.cat([all_reduce_sum(stats), norms.reshape(1)]).tolist()
    return {k: v / num_updates for k, v in zip(loss.names + ["grad_norm"], values)}


def actor_loss(
    trainee: Trainee, loss_cfg: ActorLoss, *, prompt_width: int, temperature: float, with_reference: bool = True
) -> Loss:
    """The actor's PPO :class:`Loss` on one micro-batch. The entropy is computed under autograd only when it is
    in the loss (``entropy_coeff`` != 0) or asked for (``calculate_entropy``), as verl does: otherwise no
    (N, V) softmax is kept for backward; the ``actor/entropy`` metric comes from the old-log-prob pass."""
    with_entropy = bool(loss_cfg.entropy_coeff) or loss_cfg.calculate_entropy
    with_kl = with_reference  # the batch holds the reference model's log-probs

    def loss_fn(module, mb, totals, layout):
        out = forward_response(
            module,
            mb,
            kind="actor",
            rmpad=trainee.rmpad,
            prompt_width=prompt_width,
            temperature=temperature,
            entropy_fn=trainee.sharded.entropy_fn if with_entropy else None,
            layout=layout,
        )
        mask = mb["response_mask"]
        agg = {
            "global_num_tokens": totals.tokens,
            "loss_agg_mode": loss_cfg.loss_agg_mode,
            "global_num_seqs": totals.seqs,
            "loss_scale_factor": loss_cfg.loss_scale_factor,
        }
        pg = core.compute_policy_loss(
            mb["old_log_probs"],
            out["log_prob"],
            mb["advantages"],
            mask,
            clip_ratio_low=loss_cfg.clip_ratio_low,
            clip_ratio_high=loss_cfg.clip_ratio_high,
            clip_ratio_c=loss_cfg.clip_ratio_c,
            **agg,
        )
        loss = pg["pg_loss"]
        stats = [pg["pg_loss"], pg["pg_clipfrac"], pg["pg_clipfrac_lower"], pg["ppo_kl"]]
        if with_kl:  # verl computes the KL loss only with use_kl_loss; the metric otherwise (a reference model)
            kl = core.compute_kl_loss(
                out["log_prob"], mb["ref_log_probs"], mask, kl_loss_type=loss_cfg.kl_loss_type, **agg
            )
            stats.append(kl)
            if loss_cfg.use_kl_loss:
                loss = loss + loss_cfg.kl_loss_coef * kl
        if with_entropy:
            entropy = core.compute_entropy_loss(out["entropy"], mask, **agg)
            loss = loss - loss_cfg.entropy_coeff * entropy
            stats.append(entropy)
        return loss, stats

    names = ["pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"] + (["kl_loss"] if with_kl else [])
    keys = FORWARD_KEYS + ("response_mask", "old_log_probs", "advantages") + (("ref_log_probs",) if with_kl else ())
    return Loss(loss_fn, names + (["entropy_loss"] if with_entropy else []), keys)


def update_actor(
    trainee: Trainee,
    batch: dict,
    plan: MicroBatching,
    loss_cfg: ActorLoss,
    *,
    mini_per_gpu: int,
    epochs: int,
    prompt_width: int,
    temperature: float,
    device: torch.device,
    with_reference: bool = True,
) -> dict:
    """PPO update of the actor (:func:`actor_loss`; ``with_reference``: the batch holds ``ref_log_probs``)."""
    stats = _minibatch_loop(
        trainee,
        batch,
        mini_per_gpu=mini_per_gpu,
        epochs=epochs,
        plan=plan,
        loss=actor_loss(
            trainee, loss_cfg, prompt_width=prompt_width, temperature=temperature, with_reference=with_reference
        ),
        grad_clip=loss_cfg.grad_clip,
        device=device,
    )
    return {f"actor/{k}": v for k, v in stats.items()}


def update_critic(
    trainee: Trainee,
    batch: dict,
    plan: MicroBatching,
    *,
    cliprange_value: float,
    grad_clip: float,
    mini_per_gpu: int,
    epochs: int,
    prompt_width: int,
    device: torch.device,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: int = 1,
) -> dict:
    """The critic's update: the clipped value loss aggregated by ``loss_agg_mode`` (verl's critic follows the
    actor's mode and scale factor)."""

    def loss_fn(module, mb, totals, layout):
        vpreds = forward_response(
            module, mb, kind="critic", rmpad=trainee.rmpad, prompt_width=prompt_width, layout=layout
        )["values"]
        vf = core.compute_value_loss(
            vpreds,
            mb["returns"],
            mb["values"],
            mb["response_mask"],
            cliprange_value=cliprange_value,
            global_num_tokens=totals.tokens,
            loss_agg_mode=loss_agg_mode,
            global_num_seqs=totals.seqs,
            loss_scale_factor=loss_scale_factor,
        )
        return vf["vf_loss"], [vf["vf_loss"], vf["vf_clipfrac"]]

    keys = FORWARD_KEYS + ("response_mask", "returns", "values")
    stats = _minibatch_loop(
        trainee,
        batch,
        mini_per_gpu=mini_per_gpu,
        epochs=epochs,
        plan=plan,
        loss=Loss(loss_fn, ["vf_loss", "vf_clipfrac"], keys),
        grad_clip=grad_clip,
        device=device,
    )
    return {f"critic/{k}": v for k, v in stats.items()}
