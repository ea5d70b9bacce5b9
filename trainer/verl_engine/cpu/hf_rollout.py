"""A rollout named ``hf`` for verl 0.9.1: HF ``generate`` in a Ray actor, registered through verl's
own registries (verl 0.9.1 ships vllm/sglang/trtllm server rollouts only; none runs on a CPU).

Three parts, the same three verl's vLLM rollout has:

* :class:`HFServer` -- the server (a Ray actor): token ids in, token ids and log-probs out
  (``TokenOutput``), one request at a time; new weights arrive with :meth:`HFServer.update_weights`.
* :class:`HFReplica` -- verl's ``RolloutReplica``: starts one server per replica (no accelerator).
* :class:`HFServerAdapter` -- verl's ``BaseRollout`` in each trainer rank (hybrid engine): after every
  step every rank walks the FSDP actor's full tensors (a collective), rank 0 of the replica sends them.

Generation is HF's, so throughput of this phase says nothing about vLLM's: on CPU the figure is
what the trial measured, and the run notes say which rollout produced it.
"""

from __future__ import annotations

ADAPTER = "trainer.verl_engine.cpu.hf_rollout.HFServerAdapter"


def register_hf_rollout() -> None:
    """Add ``hf`` to verl's rollout registries (both are lazy: nothing heavy is imported here)."""
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[("hf", "async")] = ADAPTER
    replica.RolloutReplicaRegistry.register("hf", _load_replica)


def _load_replica():
    from trainer.verl_engine.cpu.hf_server import HFReplica

    return HFReplica


def __getattr__(name: str):  # verl resolves ADAPTER by module attribute: import the heavy part then
    if name in ("HFServerAdapter", "HFReplica", "HFServer"):
        from trainer.verl_engine.cpu import hf_server

        return getattr(hf_server, name)
    raise AttributeError(name)
