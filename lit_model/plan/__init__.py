"""OOM foresight: predict a run's peak memory per rank before allocating anything, and the cheapest flag
changes that make it fit.

API (see planner.py): ``plan_run`` (a resolved ``lit_model.run.Run``), ``plan_training`` (a config and flags),
``plan_generation``, ``check_plan_fits``, ``max_micro_batch_size``,
``max_loss_chunk_size``, ``plot_plan``; ``Plan`` and ``Suggestion`` are the results. Tensor bytes come from the
trace (``trace.py``) or the model's memory contracts added up (``closed_form.py``). Calibration constants
(framework overhead, lever speed factors) live in ``calibration.py``; memory units in ``lit_model.core.units``.
"""

from lit_model.plan.planner import (
    Plan, Suggestion, check_plan_fits, max_loss_chunk_size, max_micro_batch_size, plan_generation, plan_run,
    plan_training,
)
from lit_model.plan.plot import plot_plan

__all__ = ["Plan", "Suggestion", "check_plan_fits", "max_loss_chunk_size", "max_micro_batch_size", "plan_generation",
           "plan_run", "plan_training", "plot_plan"]
