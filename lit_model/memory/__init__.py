"""OOM foresight: predict a run's peak memory per rank before allocating anything, and the cheapest flag
changes that make it fit.

API (see plan.py): ``plan_run`` (a resolved ``lit_model.run.Run``), ``plan_training`` (a config and flags), ``plan_generation``, ``check_plan_fits``, ``max_micro_batch_size``, ``max_loss_chunk_size``, ``parse_memory``,
``detect_device_memory``, ``plot_plan``; ``Plan`` and ``Suggestion`` are the results. Calibration constants
(framework overhead, lever speed factors) live in ``calibration.py``.
"""

from lit_model.memory.plan import (
    Plan, Suggestion, check_plan_fits, max_loss_chunk_size, max_micro_batch_size, plan_generation, plan_run, plan_training,
)
from lit_model.memory.plot import plot_plan
from lit_model.memory.units import detect_device_memory, format_bytes, parse_memory

__all__ = [
    "Plan", "Suggestion", "check_plan_fits", "detect_device_memory", "format_bytes", "max_loss_chunk_size", "max_micro_batch_size", "parse_memory",
    "plan_generation", "plan_run", "plan_training", "plot_plan",
]
