"""Our PPO engine (torch): the pure PPO math, the step as numbered phases, roles and models, FSDP wrapping
whose arguments are the knobs, attention, batching, the HF and vLLM rollouts, data and metrics."""
