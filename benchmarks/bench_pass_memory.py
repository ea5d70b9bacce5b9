"""Peak memory per pass beyond the weights, ppotune's logits path against verl 0.9.1's GPU path, on one CPU (issue 33).

Both sides run the same model (Qwen2-shaped: a small body under Qwen2.5's vocabulary of ``--vocab`` tokens, the
LM head tied to the embedding) on the same packed micro-batch of ``--tokens`` tokens (``--seqs`` sequences, half
prompt, half response), with the same attention (trainer/engine/attention.py's packed path: memory linear in
tokens on both sides, so the difference is the logits path), in ``--dtypes`` (fp32; bf16 = bf16 weights under
autocast, the compute dtype of verl's FSDP mixed precision). Passes:

* ``ref``: forward only, the log-probs (the reference model's pass);
* ``old_log_prob``: forward only, log-probs and entropy (the actor's old-log-prob pass: verl's ``actor/entropy``);
* ``update``: forward, the PPO policy loss, backward (``entropy_coeff`` 0, verl's default);
* ``update_entropy``: the same with the entropy in the loss.

ours: ``trainer.engine.passes.forward_response`` (trainer/engine/logits.py), the entropy as the engine builds it
(``make_entropy_fn``, compiled: ``use_torch_compile`` is on by default in both engines).

verl: its GPU path, reproduced on a CPU with verl's own functions where they run on a CPU
(``verl/workers/engine/fsdp/transformer_impl.py:FSDPEngineWithLMHead.prepare_model_outputs``):
``logits_rmpad = output.logits.squeeze(0)`` over every packed token (line 1382), the temperature at 1 leaves them
as they are (``_scale_logits_by_temperature``, line 98), the entropy is ``torch.compile(entropy_from_logits,
dynamic=True)`` (lines 183-187, ``verl/utils/torch_functional.py:entropy_from_logits``), the log-probs
``logprobs_from_logits(logits_rmpad, input_ids_rmpad_rolled, inplace_backward=not calculate_entropy)`` (lines
1425-1432), which on a GPU with flash-attn runs ``flash_attn/ops/triton/cross_entropy.py:cross_entropy_loss``. That
Triton kernel is the one part replaced (:class:`FlashCrossEntropyOnCpu`), by a CPU function that holds what the
kernel holds: forward, three fp32 values per row (``losses``, ``lse``, ``z_losses``), each row reduced in registers
(here: 4 rows of fp32 at a time); it saves ``(logits, lse, labels)``; backward, ``dlogits = logits if
inplace_backward else torch.empty_like(logits)``, written row block by row block. So verl's GPU path holds, beyond
the weights and the body's activations: the ``tokens x vocab`` logits in the compute dtype (``T V c``), 12 B per
token, and in an update with the entropy in the loss, the gradient's ``T V c`` twice (the cross-entropy's
``empty_like`` and the entropy's).

Measured: peak RSS per pass (``/proc/self/clear_refs`` resets VmHWM), minus the RSS before it (weights, batch,
compiled code), with glibc's mmap threshold fixed so that every large tensor is returned when freed. One worker
process per side and dtype, passes interleaved (the order alternates every round), medians of ``--rounds``.

    python benchmarks/bench_pass_memory.py [--tokens 2048] [--vocab 151936] [--dtypes fp32,bf16] [--rounds 3]
        [--json FILE]

Both sides run in verl's venv by default (verl's functions import there); ``--ours-python`` moves ours. Run it alone
on the machine (it measures memory). Exit 1 when ours exceeds ``GOAL`` x verl's on a pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from side_by_side import WorkerProcess, answer, requests, write_record

REPO = Path(__file__).resolve().parent.parent
VERL_PY = REPO / ".venv-verl" / "bin" / "python"
PASSES = ("ref", "old_log_prob", "update", "update_entropy")
#: issue 33's goal: ours at most 1.1x verl's GPU path on every pass
GOAL = 1.1


# --------------------------------------------------------------------------- the shared model and micro-batch
def build(args, dtype_name: str):
    """(model, packed batch) of one side: the same seed, shape and tokens for both."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.engine.attention import PACKED_ATTENTION
    from trainer.engine.step import assemble_batch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cfg = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=args.tokens,
    )  # fmt: skip
    cfg._attn_implementation = PACKED_ATTENTION
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    g = torch.Generator().manual_seed(1)
    length = args.tokens // args.seqs
    P = R = length // 2
    ones = torch.ones(args.seqs, P, dtype=torch.long)
    prompts = torch.randint(0, args.vocab, (args.seqs, P), generator=g)
    responses = torch.randint(0, args.vocab, (args.seqs, R), generator=g)
    batch = assemble_batch(prompts, ones, responses, ones.clone())
    batch["old_log_probs"] = -torch.rand(args.seqs, R, generator=g) * 5
    batch["advantages"] = torch.randn(args.seqs, R, generator=g)
    return model, batch, P, dtype


def _policy_loss(log_probs, old, adv, mask, entropy=None):
    """The PPO loss both sides put on their per-token values (the same formula; its memory is per token)."""
    from trainer.engine import core

    n = mask.sum().double()
    pg = core.compute_policy_loss(
        old, log_probs, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, global_num_tokens=n
    )["pg_loss"]
    if entropy is None:
        return pg
    return pg - 0.01 * core.compute_entropy_loss(entropy, mask, global_num_tokens=n)


class Ours:
    """ppotune's pass: forward_response over the packed micro-batch (the engine's own function)."""

    def __init__(self, args, dtype_name: str) -> None:
        from trainer.engine.parallelize import make_entropy_fn

        self.model, self.batch, self.P, self.dtype = build(args, dtype_name)
        self.entropy_fn = make_entropy_fn(chunk_size=None, checkpointing=False, compile=True)

    def run(self, name: str) -> None:
        import torch

        from trainer.engine.passes import forward_response

        grad = name.startswith("update")
        entropy = self.entropy_fn if name in ("old_log_prob", "update_entropy") else None
        with torch.set_grad_enabled(grad), _autocast(self.dtype):
            out = forward_response(self.model, self.batch, kind="actor", rmpad=True, prompt_width=self.P,
                                   entropy_fn=entropy)  # fmt: skip
            if not grad:
                return
            b = self.batch
            loss = _policy_loss(out["log_prob"], b["old_log_probs"], b["advantages"], b["response_mask"],
                                out.get("entropy"))  # fmt: skip
        loss.backward()
        self.model.zero_grad(set_to_none=True)


class FlashCrossEntropyOnCpu:
    """The memory of flash-attn's Triton ``cross_entropy_loss`` on a CPU (see the module's docstring): its outputs,
    its saved tensors and its in-place backward, the per-row work on 4 rows at a time."""

    BLOCK = 4

    def __init__(self) -> None:
        import torch

        block = self.BLOCK

        class CrossEntropy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, logits, labels, inplace_backward):
                n = logits.shape[0]
                losses, lse, z_losses = (torch.empty(n, dtype=torch.float32) for _ in range(3))
                for s in range(0, n, block):
                    x = logits[s : s + block].float()
                    lse[s : s + block] = torch.logsumexp(x, dim=-1)
                    losses[s : s + block] = lse[s : s + block] - x.gather(-1, labels[s : s + block, None])[:, 0]
                z_losses.zero_()
                ctx.save_for_backward(logits, lse, labels)
                ctx.inplace_backward = inplace_backward
                ctx.mark_non_differentiable(z_losses)
                return losses, z_losses

            @staticmethod
            def backward(ctx, grad_losses, grad_z_losses):
                logits, lse, labels = ctx.saved_tensors
                dlogits = logits if ctx.inplace_backward else torch.empty_like(logits)
                for s in range(0, logits.shape[0], block):
                    p = (logits[s : s + block].float() - lse[s : s + block, None]).exp_()
                    p.scatter_add_(-1, labels[s : s + block, None], -torch.ones_like(p[:, :1]))
                    dlogits[s : s + block] = p * grad_losses[s : s + block, None]
                return dlogits, None, None

        self.apply = CrossEntropy.apply

    def __call__(self, logits, labels, inplace_backward=False):
        return self.apply(logits, labels, inplace_backward)


class Verl:
    """verl 0.9.1's GPU path on the same model and tokens: its own logits handling and functions, flash-attn's
    kernel replaced by :class:`FlashCrossEntropyOnCpu`."""

    def __init__(self, args, dtype_name: str) -> None:
        import torch
        from verl.utils import torch_functional as verl_F

        from trainer.engine.batching import build_layouts, host_masks

        os.environ.pop("VERL_DISABLE_FLASH_ATTN_CE", None)
        verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = True  # the GPU path with flash-attn installed
        verl_F.cross_entropy_loss = FlashCrossEntropyOnCpu()
        self.verl_F = verl_F
        self.entropy = torch.compile(verl_F.entropy_from_logits, dynamic=True)  # use_torch_compile's default
        self.model, batch, self.P, self.dtype = build(args, dtype_name)
        (layout,) = build_layouts(host_masks(batch), [list(range(batch["input_ids"].shape[0]))], pad_to_multiple=None,
                                  device=torch.device("cpu"))  # fmt: skip
        self.layout, self.batch = layout, batch
        ids = batch["input_ids"].reshape(-1).index_select(0, layout.token_index)[None]
        self.ids, self.pos = ids, batch["position_ids"].reshape(-1).index_select(0, layout.token_index)[None]
        self.rolled = torch.roll(ids, shifts=-1, dims=1)[0]  # input_ids_rmpad_rolled: the next token's id

    def run(self, name: str) -> None:
        import torch

        from trainer.engine.attention import varlen_kwargs

        grad = name.startswith("update")
        calculate_entropy = name in ("old_log_prob", "update_entropy")
        lay, b = self.layout, self.batch
        with torch.set_grad_enabled(grad), _autocast(self.dtype):
            output = self.model(input_ids=self.ids, position_ids=self.pos, use_cache=False,
                                **varlen_kwargs(lay.seq_lens, lay.cu_seq_lens))  # fmt: skip
            logits_rmpad = output.logits.squeeze(0)
            entropy = self.entropy(logits_rmpad) if calculate_entropy else None
            log_probs = self.verl_F.logprobs_from_logits(
                logits_rmpad, self.rolled, inplace_backward=not calculate_entropy
            )
            if not grad:
                return
            # the response tokens' values as the loss reads them, (b, R)
            shape = b["responses"].shape
            ent = _responses(entropy, lay, shape) if entropy is not None else None
            loss = _policy_loss(
                _responses(log_probs, lay, shape), b["old_log_probs"], b["advantages"], b["response_mask"], ent
            )
        loss.backward()
        self.model.zero_grad(set_to_none=True)


def _responses(per_token, layout, shape):
    """(T,) values of every packed token -> (b, R): those that predict a response token, in their place."""
    import torch

    picked = per_token.index_select(0, layout.predictor)
    return torch.zeros(shape, dtype=per_token.dtype).view(-1).index_copy(0, layout.response_index, picked).view(shape)


def _autocast(dtype):
    import contextlib

    import torch

    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


# --------------------------------------------------------------------------- measuring one pass
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_beyond(fn) -> int:
    """Bytes the peak RSS of ``fn`` rose above the RSS before it."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - before) * 1024


def worker_main(side: str, args) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(args.threads)
    actors = {dtype: (Verl if side == "verl" else Ours)(args, dtype) for dtype in args.dtypes.split(",")}
    for actor in actors.values():  # first-use costs (compiles, lazy allocations) before any measure
        for name in PASSES:
            actor.run(name)
    answer({"ready": side})
    for ask in requests():
        actor = actors[ask["dtype"]]
        answer({"bytes": peak_beyond(lambda: actor.run(ask["pass"]))})


class Worker(WorkerProcess):
    def __init__(self, side: str, python: str, args) -> None:
        flags = [f"--{k}={getattr(args, k)}" for k in ("tokens", "seqs", "vocab", "hidden", "dtypes", "threads")]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads),
               "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}  # fmt: skip
        super().__init__(side, [python, str(Path(__file__).resolve()), "--worker", side, *flags], env)


def formula_bytes(args, dtype: str, name: str) -> int:
    """verl's GPU path beyond the weights, its logits terms only (the module's docstring): ``T V c`` + 12 B per
    token, + ``2 T V c`` in an update with the entropy in the loss."""
    c = {"fp32": 4, "bf16": 2}[dtype]
    T = args.seqs * (args.tokens // args.seqs)
    return T * args.vocab * c * (3 if name == "update_entropy" else 1) + 12 * T


def table(got: dict, args) -> tuple[str, list[str]]:
    lines = [f"{'dtype':<6}{'pass':<16}{'ours MB':>10}{'verl MB':>10}{'ours/verl':>11}{'verl formula MB':>17}"]
    missed = []
    for dtype in args.dtypes.split(","):
        for name in PASSES:
            ours, verl = (statistics.median(got[dtype][name][s]) / 2**20 for s in ("ours", "verl"))
            ratio = ours / verl if verl else float("nan")
            lines.append(f"{dtype:<6}{name:<16}{ours:>10.1f}{verl:>10.1f}{ratio:>11.2f}"
                         f"{formula_bytes(args, dtype, name) / 2**20:>17.1f}")  # fmt: skip
            if not ratio <= GOAL:
                missed.append(f"{dtype} {name}: ours {ratio:.2f}x verl's (goal <= {GOAL})")
    return "\n".join(lines), missed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=("ours", "verl"), help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens of the micro-batch")
    ap.add_argument("--seqs", type=int, default=16, help="sequences in it (half prompt, half response each)")
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's vocabulary")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ours-python", default=str(VERL_PY))
    ap.add_argument("--verl-python", default=str(VERL_PY))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args)
        return 0
    if not Path(args.verl_python).exists():
        print(f"bench_pass_memory: verl's venv {args.verl_python} is missing (scripts/install_test_deps.sh)")
        return 2
    workers = {side: Worker(side, py, args) for side, py in (("ours", args.ours_python), ("verl", args.verl_python))}
    got: dict = {}
    try:
        for r in range(args.rounds):
            order = ["ours", "verl"] if r % 2 == 0 else ["verl", "ours"]
            for dtype in args.dtypes.split(","):
                for name in PASSES:
                    for side in order:
                        got.setdefault(dtype, {}).setdefault(name, {}).setdefault(side, []).append(
                            workers[side].ask({"dtype": dtype, "pass": name})["bytes"]
                        )
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    text, missed = table(got, args)
    T = args.seqs * (args.tokens // args.seqs)
    print(f"peak memory per pass beyond the weights, medians of {args.rounds} rounds ({T} packed tokens, "
          f"{args.seqs} sequences, vocabulary {args.vocab}, hidden {args.hidden}):")  # fmt: skip
    print(text)
    print(f"goal (ours <= {GOAL}x verl's GPU path on every pass):", "met" if not missed else "; ".join(missed))
    if args.json:
        write_record(args.json, bytes=got, missed=missed)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
