"""What a study found: ``ppotune report``, ``ppotune export`` and the notebook.

Everything here reads a study and never writes to it. By role:

* :mod:`~tuner.results.view` -- the study read once, one row per trial, the Pareto front
  (no matplotlib: ``ppotune search`` prints its summary from it);
* :mod:`~tuner.results.analysis` -- importances, knobs with no effect, search cost, baseline vs best;
* :mod:`~tuner.results.plots` -- the matplotlib figures;
* :mod:`~tuner.results.html` -- ``report.html`` and ``summary.md``;
* :mod:`~tuner.results.report` -- the report's files (``ppotune report``, ``search --report``);
* :mod:`~tuner.results.pick` -- which trial export recommends (the decision, no file written);
* :mod:`~tuner.results.why` -- why.md: why that trial, the runner-up, the margin to the OOM boundary;
* :mod:`~tuner.results.export` -- the chosen config, verl overrides, why.md (``ppotune export``);
* :mod:`~tuner.results.validation` -- ``ppotune validate``'s verdict;
* :mod:`~tuner.results.verl_validate` -- exported overrides checked against verl's own config.

Import the submodule you need; this package imports nothing.
"""
