"""Pure rules several of the tuner's packages borrow: nothing here starts a process, opens a storage or asks a
sampler, and nothing here imports another tuner package but :mod:`tuner.space` and :mod:`tuner.memory_model`."""
