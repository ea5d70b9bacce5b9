"""``ppotune fit``: the largest per-GPU sizes whose worst-case step keeps the headroom free, in a handful of probes.

* :mod:`tuner.fit.ladder`: the size knobs a base config uses, each with its ladder (pure);
* :mod:`tuner.fit.boundary`: each knob's interval, what a probe says, what to probe next (pure);
* :mod:`tuner.fit.propose`: the memory model's proposals and the values it rules out (pure);
* :mod:`tuner.fit.answer`: the per-knob table (pure);
* :mod:`tuner.fit.inputs`: what a fit is about, checked before anything runs;
* :mod:`tuner.search.fit_probes`: the probes as trials of a study, the state kept in it (effects);
* :mod:`tuner.fit.bounds`: a search started from a fit (``ppotune search --from-fit DIR``).

The command is :mod:`tuner.commands.fit`; the files and the report's table are :mod:`tuner.results.fit_files`.
"""
