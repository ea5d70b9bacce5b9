"""The process side of a run, torch-free: ``ppotune train`` (validate, start ranks, write the result JSON),
the rank group, the warm job's protocol, ``ppotune check`` and process helpers."""
