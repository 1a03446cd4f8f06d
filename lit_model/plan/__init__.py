"""OOM foresight: predict a run's peak memory per rank before allocating anything, and the cheapest flag
changes that make it fit. Import what you need from its modules; this package imports none of them, so that
generation's planner comes without the training stack (lightning):

- ``training.py``: ``plan_training`` (a config and flags), ``plan_run`` (a resolved ``lit_model.run.Run``);
  ``generation.py``: ``plan_generation``; ``report.py``: ``Plan``, ``Suggestion``, ``check_plan_fits``;
  ``search.py``: ``max_micro_batch_size``, ``max_loss_chunk_size``, ``suggest_changes``; ``plot.py``: ``plot_plan``.
- Tensor bytes come from the trace (``trace.py``, generation's ``trace_generation.py``, both measuring with
  ``tracker.py``) or the model's memory contracts added up (``closed_form.py``), chosen by ``planner.py``; the
  framework overhead on top from ``overhead.py``. Calibration constants (framework overhead, lever speed factors)
  live in ``calibration.py``; memory units in ``lit_model.core.units``.
"""
