"""OOM foresight: predict a run's peak memory per rank before allocating anything, and the cheapest flag
changes that make it fit.

API (see plan.py): ``plan_run`` (a resolved ``lit_model.run.Run``), ``plan_training`` (a config and flags), ``plan_generation``, ``print_generation_plan``, ``check_plan_fits``, ``max_micro_batch_size``, ``max_loss_chunk_size``, ``parse_memory``,
``detect_device_memory``, ``plot_plan``; ``Plan`` and ``Suggestion`` are the results. Calibration constants
(framework overhead, lever speed factors) live in ``calibration.py``.
"""

from typing import Any

from lit_model.core.units import detect_device_memory, format_bytes, parse_memory

# The planner traces the training step (lit_model.train.loop), whose modules import memory.units: the planner
# loads on first use, so importing this package for its units does not import the training code.
_PLAN = ("Plan", "Suggestion", "check_plan_fits", "max_loss_chunk_size", "max_micro_batch_size", "plan_generation",
         "plan_run", "plan_training", "print_generation_plan")

__all__ = [*_PLAN, "detect_device_memory", "format_bytes", "parse_memory", "plot_plan"]


def __getattr__(name: str) -> Any:
    if name in _PLAN:
        from lit_model.plan import planner as plan

        return getattr(plan, name)
    if name == "plot_plan":
        from lit_model.plan.plot import plot_plan

        return plot_plan
    raise AttributeError(f"module 'lit_model.plan' has no attribute {name!r}")
