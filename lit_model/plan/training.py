"""The plan of a training run: ``plan_training`` (a config and a script's flags) and ``plan_run`` (a resolved
``lit_model.run.Run``), with its ``auto`` micro batch and loss chunk and, where it does not fit, the cheapest flag
changes that make it fit (``search.py``).

    from lit_model.core.units import parse_memory
    from lit_model.plan.training import plan_training
    plan = plan_training(Config.from_name("Llama-2-7b-hf"), args, trainable="lora", device_memory=parse_memory("24GB"))
    print(plan.to_text())          # or plan.to_json()
    if not plan.fits:
        args = plan.suggestions[0].apply(args)

Tensor bytes come from the exact trace (``trace.py``) or the closed-form model (``closed_form.py``, engine
"analytic"), chosen by ``planner.py``; the framework overhead on top of them from ``overhead.py``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lit_model.core.config import Config
from lit_model.core.errors import UsageError
from lit_model.core.units import format_bytes
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.plan.calibration import OVERHEAD
from lit_model.plan.overhead import cuda_step_fresh_bytes
from lit_model.plan.planner import _assemble, _tensor_phases
from lit_model.plan.report import Plan, Suggestion, _resolve_memory
from lit_model.plan.search import max_loss_chunk_size, max_micro_batch_size, suggest_changes
from lit_model.run import Run, resolve_run


class TrainingPlan(Plan):
    """A training run's plan, as ``plan_run`` hands it out: one that can plan its suggestions in turn."""

    def replan(self, suggestion: Suggestion, engine: str = "auto") -> TrainingPlan:
        """Plan the suggested run (same device memory)."""
        if suggestion.run is None:
            raise ValueError("Only training plans can be re-planned with a suggestion.")
        return plan_run(suggestion.run, self.device_memory, engine=engine, detect=False)


def plan_training(
    config: Config,
    settings: Any,
    trainable: str = "full",
    quantize: Optional[str] = None,
    device_memory: Union[int, str, None] = None,
    device_type: str = "cuda",
    world_size: Optional[int] = None,
    *,
    engine: str = "auto",
    suggest: bool = True,
    max_suggestions: int = 5,
    detect: bool = True,
) -> TrainingPlan:
    """Predicted peak memory per rank of training ``config`` with ``settings`` (a script's parsed flags: a
    TrainArgs), resolved by ``lit_model.run.resolve_run`` as the script resolves them, for a device that need
    not be this machine's. The other arguments are ``plan_run``'s and ``resolve_run``'s."""
    if device_type not in ("cuda", "cpu"):
        raise UsageError(f"device_type={device_type!r}: plan for 'cuda' or 'cpu'.")
    run = resolve_run(settings, config, trainable, device_type, present=False, world_size=world_size, quantize=quantize)
    return plan_run(run, device_memory, engine=engine, suggest=suggest, max_suggestions=max_suggestions, detect=detect)


def plan_run(
    run: Run,
    device_memory: Union[int, str, None] = None,
    *,
    engine: str = "auto",
    suggest: bool = True,
    max_suggestions: int = 5,
    detect: bool = True,
) -> TrainingPlan:
    """Predicted peak memory per rank of a resolved run. device_memory: bytes or "24GB"; None detects it when
    planning for this machine's device type (``detect``), else the plan has no verdict (fits=True). engine: "trace"
    or its alias "auto" (exact, seconds; the closed form, rounded up and with a note, where the trace cannot plan the
    run) or "analytic" (the closed form alone, milliseconds). ``--micro_batch_size auto`` is planned with the micro
    batch it would pick."""
    memory = _resolve_memory(device_memory, run.device_type, detect)
    notes: list[str] = []
    if run.micro_batch_auto:
        best = max_micro_batch_size(run, memory, confirm_with_trace=False if engine == "analytic" else None) if memory else 1
        run = run.replace(micro_batch_size=max(best, 1), micro_batch_auto=False)
        notes.append(f"--micro_batch_size auto: {max(best, 1)} (the largest that fits with a 10 % margin)"
                     if best else "--micro_batch_size auto: not even 1 fits; planned with 1.")
    if run.loss_chunk_auto:
        chunk = max_loss_chunk_size(run, memory) if memory else DEFAULT_LOSS_CHUNK_SIZE
        run = run.replace(loss_chunk_size=chunk, loss_chunk_auto=False)
        notes.append(f"--loss_chunk_size auto: {chunk} tokens (the largest whose logits fit with a 10 % margin)")
    phases, used, offloaded, highs = _tensor_phases(run, engine, notes)
    plan = _assemble(run, phases, memory, used, notes, offloaded, transient_highs=highs, kind=TrainingPlan)
    if run.seq_len_source:
        plan.notes.append(f"Sequence length {run.seq_len}: {run.seq_len_source}.")
    if memory is None:
        plan.notes.append("No device memory given or detected: pass --device_memory (e.g. 24GB) for a verdict.")
    if run.compile:
        plan.notes.append("--compile (each block compiled) is not traced: these are the eager run's tensors, which the "
                          "compiled runs matched or stayed below on a GPU (pretraining pythia-160m: 1 % less allocated; "
                          "LoRA and QLoRA 15-21 % less, which keeps fewer activations; "
                          "benchmarks/results/plan_accuracy_gpu.md); on the CPU the compiler and its code add the "
                          "compiled_code term (an estimate from five runs).")
    if run.config.n_expert and run.device_type == "cpu" and run.compute_bytes == 2:
        plan.notes.append("Half-precision matmuls on the CPU make a kernel for every new expert row count, so the "
                          "process grows over the first steps until oneDNN's capped kernel caches are full: the "
                          "kernel cache term counts them full (benchmarks/results/moe_plan.md).")
    if run.device_type == "cuda":
        plan.notes.append(f"GPU overhead: CUDA context {format_bytes(OVERHEAD.cuda_context)}, cuBLAS workspaces "
                          f"{format_bytes(OVERHEAD.cuda_workspaces)} and the caching allocator's reserve "
                          f"({OVERHEAD.cuda_fragmentation:.0%} of the tensors other than the weights, "
                          f"{OVERHEAD.cuda_fragmentation_expandable:.0%} with expandable segments), measured on one H200 "
                          "(torch 2.11) and rounded up; other GPUs and drivers differ by a few hundred MB "
                          "(benchmarks/results/plan_accuracy_gpu.md).")
        fresh = cuda_step_fresh_bytes(run)
        if fresh:
            plan.notes.append(f"{run.optimizer}'s compiled step makes {format_bytes(fresh)} of temporaries for the "
                              "largest parameter after backward, which the allocator maps anew: counted on top of the "
                              "reserve (an estimate from one H200 run).")
    else:
        terms = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in plan.overhead_terms.items())
        plan.notes.append(f"CPU overhead per process: {terms} (measured on whole runs here and rounded up; the data term "
                          "is an estimate for the default data, the allocator's for glibc's default settings).")
    if run.parallel.fsdp and run.device_type == "cuda":
        plan.notes.append(
            f"The final checkpoint gathers the full weights into rank 0's CPU memory: "
            f"{format_bytes(plan.host_bytes.get('checkpoint_save_rank0', 0))} of host RAM."
        )
    if suggest and memory is not None and (not plan.fits or plan.paged_bytes):
        plan.suggestions = suggest_changes(run, memory, max_suggestions, engine=engine)
        if not plan.suggestions:
            plan.notes.append("No combination of up to 3 flag changes fits this device.")
    return plan


