"""Where activations live (lit_model/parallel/activations.py, applied by parallel/apply.py): selective activation checkpointing, activation offloading and
the tiled MLP each lower the memory of a step -- measured on real tensors with MemTracker and planned by the trace --
and leave the loss and the gradients as they were."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lit_model.parallel.activations import ActivationOffloading
from lit_model.parallel.apply import Levers, offloading_of, parallelize
from lit_model.parallel.dims import ParallelDims
from lit_model.recipes.cli import parse
from lit_model.core.errors import UsageError
from lit_model.plan.training import plan_run
from lit_model.run import CPU_HEAP_TOP_PAD, changed_flags, render_flags, resolve_run
from lit_model.train.args import TrainArgs, check_args
from lit_model.methods.objective import CausalLM, mean_loss
from test_memory_plan import args as plan_args, resolved, tiny
from test_training_levers import batch, gradients, make_model

CPU = torch.device("cpu")


def measured(setup) -> tuple[float, float, torch.Tensor, dict[str, torch.Tensor]]:
    """(tensor bytes alive at the end of forward, peak tensor bytes of forward + backward, loss, gradients) of
    the levers model with ``setup`` applied, measured on real tensors by MemTracker."""
    inputs, targets = batch()
    model = make_model()
    setup(model)
    tracker = MemTracker()
    tracker.track_external(model, inputs, targets)
    with tracker:
        loss = mean_loss(CausalLM(), model, (inputs, targets))
        after_forward = tracker.get_tracker_snapshot()[CPU]["Total"]
        loss.backward()
    return after_forward, tracker.get_tracker_snapshot("peak")[CPU]["Total"], loss.detach(), gradients(model)


def assert_same_numbers(run, reference, exact: bool = True) -> None:
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(run[2], reference[2], **tolerance)
    for name, grad in reference[3].items():
        torch.testing.assert_close(run[3][name], grad, **tolerance, msg=name)


def planned(**flags) -> dict:
    """The trace's plan of a 4-block tiny model at 1024 tokens with these flags: train-step activations, peak, host."""
    run = resolved(tiny(n_layer=4, block_size=1024), plan_args(override_max_seq_length=1024, **flags))
    plan = plan_run(run, engine="trace", suggest=False, detect=False)
    assert plan.engine == "trace"
    return {"activations": plan.phase_categories["train_step"]["activations"], "peak": plan.tensor_peak_bytes,
            "host": plan.host_bytes}


ONE_DEVICE = ParallelDims(dp_replicate=1, dp_shard=1)


def with_levers(**levers):
    """A ``measured`` setup: the levers applied to the model as training applies them."""
    return lambda model: parallelize(model, ONE_DEVICE, Levers(**levers))


selective, full = with_levers(ac_interval=1, ac_selective=True), with_levers(ac_interval=1)


@pytest.mark.slow
def test_selective_checkpointing_keeps_between_none_and_full_with_the_same_numbers():
    plain, sac, ac = measured(lambda model: None), measured(selective), measured(full)
    assert ac[0] < sac[0] < 0.8 * plain[0], (ac[0], sac[0], plain[0])
    assert sac[1] < plain[1]
    assert_same_numbers(sac, plain)  # recomputation on the CPU in fp32: bit for bit
    none, sac_plan, ac_plan = planned(), planned(activation_checkpointing="selective"), planned(activation_checkpointing=True)
    assert ac_plan["activations"] < sac_plan["activations"] < 0.8 * none["activations"]


def test_disk_offloading_moves_saved_tensors_to_files_and_removes_them(tmp_path):
    offloaded = []
    plain = measured(lambda model: None)
    moved = measured(lambda model: offloaded.append(with_levers(offload="disk", offload_dir=tmp_path)(model)))
    offloading = offloading_of(offloaded[0])
    assert moved[0] < 0.2 * plain[0] and moved[1] < 0.5 * plain[1], (moved[:2], plain[:2])
    assert_same_numbers(moved, plain)
    assert offloading.peak_bytes > 0.7 * plain[0] and offloading.held_bytes == 0
    assert not list(tmp_path.rglob("*.tmp"))  # read back and deleted in backward
    # a step abandoned after its forward (an out-of-memory, a stop) leaves no file behind either
    model = with_levers(offload="disk", offload_dir=tmp_path)(make_model())
    offloading = offloading_of(model)
    loss = mean_loss(CausalLM(), model, batch())
    assert list(tmp_path.rglob("*.tmp"))
    del loss
    gc.collect()
    assert not list(tmp_path.rglob("*.tmp")) and offloading.held_bytes == 0


@pytest.mark.slow
def test_offloading_with_checkpointing_moves_only_the_block_inputs(tmp_path):
    offloaded = []
    ac = measured(full)
    both = measured(lambda model: offloaded.append(with_levers(ac_interval=1, offload="disk", offload_dir=tmp_path)(model)))
    offloading = offloading_of(offloaded[0])
    assert both[0] < ac[0]
    assert_same_numbers(both, ac)
    inputs, _ = batch()
    block_input = inputs.numel() * make_model().config.n_embd * 4
    assert offloading.peak_bytes == make_model().config.n_layer * block_input


@pytest.mark.slow
def test_offloading_is_planned_as_host_memory():
    none, cpu, disk = planned(), planned(activation_offloading="cpu"), planned(activation_offloading="disk")
    assert cpu["activations"] < 0.2 * none["activations"] and cpu["peak"] < none["peak"]
    assert cpu["host"]["activation_offloading_cpu"] > 0.7 * none["activations"]
    assert disk["host"]["activation_offloading_disk"] == cpu["host"]["activation_offloading_cpu"]
    stacked = planned(activation_checkpointing=True, activation_offloading="cpu")
    assert stacked["activations"] < planned(activation_checkpointing=True)["activations"]


def test_cpu_offloading_is_refused_on_the_cpu_and_offload_dir_needs_disk(tmp_path):
    settings = TrainArgs(activation_offloading="cpu", max_steps=1, out_dir=tmp_path)
    with pytest.raises(UsageError, match="--activation_offloading disk"):
        resolve_run(settings, tiny(), device_type="cpu")
    assert resolve_run(settings, tiny(), device_type="cuda", present=False).activation_offloading == "cpu"
    disk = resolve_run(TrainArgs(activation_offloading="disk", out_dir=tmp_path), tiny(), device_type="cpu")
    assert disk.offload_dir == tmp_path / "activations" and not disk.offload_dir.exists()
    with pytest.raises(UsageError, match="--activation_offloading disk"):
        check_args(TrainArgs(offload_dir=tmp_path, max_steps=1, out_dir=tmp_path))


@pytest.mark.slow
def test_tiled_mlp_keeps_less_with_the_same_numbers():
    plain, tiled = measured(lambda model: None), measured(with_levers(mlp_tiles=4))
    assert tiled[0] < 0.75 * plain[0] and tiled[1] < plain[1], (tiled[:2], plain[:2])
    assert_same_numbers(tiled, plain, exact=False)  # the weight gradients are summed over the tiles
    assert planned(mlp_tiles=4)["activations"] < 0.75 * planned()["activations"]


def test_the_flags_read_and_render_as_the_user_writes_them(tmp_path):
    settings = parse(TrainArgs, ["--activation_checkpointing", "selective", "--mlp_tiles", "2", "--max_steps", "1"])
    run = resolve_run(settings, tiny(), device_type="cpu")
    assert run.ac_interval == 1 and run.ac_selective and run.mlp_tiles == 2
    assert parse(TrainArgs, ["--activation_checkpointing", "--max_steps", "1"]).activation_checkpointing is True
    plain = resolve_run(TrainArgs(max_steps=1), tiny(), device_type="cpu")
    assert sorted(render_flags(changed_flags(plain, run))) == ["--activation_checkpointing selective", "--mlp_tiles 2"]
    offloaded = plain.replace(activation_offloading="disk", offload_dir=Path(tmp_path))
    assert render_flags(changed_flags(plain, offloaded)) == ["--activation_offloading disk"]


# ---- the CUDA allocator's settings and the loss chunk (long-context companions) -----------------------------------
def test_expandable_segments_are_set_for_a_cuda_run_unless_the_user_set_the_allocator(monkeypatch, tmp_path):
    from lit_model.run import DEFAULT_CUDA_ALLOC_CONF
    from lit_model.train.fabric import set_cuda_allocator

    for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    settings = TrainArgs(max_steps=1, out_dir=tmp_path)
    cpu_run = resolve_run(settings, tiny(), device_type="cpu")
    set_cuda_allocator(cpu_run)
    assert cpu_run.cuda_alloc_conf is None and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    cuda_run = resolve_run(settings, tiny(), device_type="cuda", present=False)
    assert cuda_run.cuda_alloc_conf == DEFAULT_CUDA_ALLOC_CONF
    set_cuda_allocator(cuda_run)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT_CUDA_ALLOC_CONF
    # the user's own settings win, and the planner's fragmentation follows them
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    own = resolve_run(settings, tiny(), device_type="cuda", present=False)
    set_cuda_allocator(own)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == own.cuda_alloc_conf == "max_split_size_mb:128"
    expandable, default = (plan_run(r, engine="analytic", suggest=False, detect=False) for r in (cuda_run, own))
    assert expandable.by_category["overhead"] < default.by_category["overhead"]
    assert expandable.tensor_peak_bytes == default.tensor_peak_bytes


# A process that allocates four blocks of 8 MiB and frees them, twenty times (a small step's activations), then
# prints its minor page faults in that loop.
_HEAP_CHURN = """
import resource, sys, torch
from lit_model.run import resolve_run
from lit_model.train.args import TrainArgs
from lit_model.train.fabric import set_cpu_heap
from test_memory_plan import tiny
run = resolve_run(TrainArgs(max_steps=1, out_dir=sys.argv[1]), tiny(), device_type="cpu")
set_cpu_heap(run)
for _ in range(3):
    blocks = [torch.ones(2 << 20) for _ in range(4)]
    del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    blocks = [torch.ones(2 << 20) for _ in range(4)]
    del blocks
print(run.cpu_heap, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_cpu_run_keeps_its_freed_heap_instead_of_faulting_it_back_every_step(tmp_path):
    """At glibc's defaults, 32 MiB freed at the heap's top is more than its trim threshold (twice the largest block
    it has mapped, here 8 MiB) and goes back to the OS, so the next step faults it in again page by page; with the
    run's heap settings it is reused. A MALLOC_* variable of the user's leaves glibc alone, and the planner counts
    the heap's top pad exactly when the run sets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])

    def churn(extra: dict[str, str]) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _HEAP_CHURN, str(tmp_path)], env={**env, **extra}, check=True,
                             capture_output=True, text=True).stdout.split()
        return out[0], int(out[1])

    tuned = churn({})
    # the user's MALLOC_* variable: here glibc's default. glibc's adaptive thresholds only rise: in about one fresh
    # process in five something frees a mapped block of 16 MiB or more before the churn (seen while other processes
    # loaded the machine), which lifts them to where the run's settings fix them, and that process faults nothing
    # back either. The defaults' behaviour is the first of up to four processes whose thresholds did not start high.
    defaults = (churn({"MALLOC_PERTURB_": "0"}) for _ in range(4))
    default = next((d for d in defaults if d[1] > 20 * 4 * 2048 // 2), ("glibc", 0))
    assert tuned[0] == "lit_model" and default[0] == "glibc"
    assert tuned[1] < 200 and default[1] > 20 * 4 * 2048 // 2, (tuned, default)  # 2,048 pages of 4 KiB in 8 MiB
    run = resolve_run(TrainArgs(max_steps=1, out_dir=tmp_path), tiny(), device_type="cpu")
    plan = plan_run(run, engine="analytic", suggest=False, detect=False)
    assert plan.overhead_terms.get("heap_top_pad") == (CPU_HEAP_TOP_PAD if run.cpu_heap == "lit_model" else None)
    cuda = resolve_run(TrainArgs(max_steps=1, out_dir=tmp_path), tiny(), device_type="cuda", present=False)
    assert cuda.cpu_heap == "glibc"


def test_loss_chunk_auto_picks_the_largest_chunk_that_fits(tmp_path):
    from lit_model.plan.search import max_loss_chunk_size

    settings = plan_args(loss_chunk_size="auto", override_max_seq_length=1024, micro_batch_size=4)
    run = resolved(tiny(n_layer=4, block_size=1024), settings)
    assert run.loss_chunk_auto
    peaks = {chunk: plan_run(run.replace(loss_chunk_size=chunk, loss_chunk_auto=False), engine="trace",
                             suggest=False, detect=False).peak_bytes for chunk in (128, 256, 512, 1024, 2048, 4096)}
    assert peaks[4096] > peaks[512]  # the logits of larger chunks show in the peak
    room = peaks[128]
    assert max_loss_chunk_size(run, 100 * room) == 4096  # the whole micro batch at once
    assert max_loss_chunk_size(run, int(peaks[512] / 0.9) + 10) == max(c for c, peak in peaks.items() if peak <= peaks[512])
    assert max_loss_chunk_size(run, room) == 128  # nothing fits: the default
    roomy = 4096
    plan = plan_run(run, 100 * room, engine="analytic", suggest=False)
    assert plan.planned.loss_chunk_size == roomy and any("--loss_chunk_size auto: 4096" in n for n in plan.notes)
    assert max_loss_chunk_size(run.replace(device_type="cpu"), 100 * room) == 128  # cache-sized chunks: fastest


def test_disk_offloading_leaves_a_saved_storage_resizable(tmp_path):
    """FSDP frees its unsharded parameters after forward by resizing their storages to 0, and a saved tensor may view
    one (LoRA's frozen base weight): writing it to a file must not pin the storage (a numpy view did: "Trying to
    resize storage that is not resizable", found by plan_accuracy --random), and backward gets the same values."""
    weight = torch.randn(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    with ActivationOffloading("disk", tmp_path)():
        y = (x @ weight.t()).relu()  # saves x, weight.t() (a view of weight's storage) and the output
    assert list(tmp_path.iterdir())  # they went to files
    expected = weight.clone()
    storage = weight.untyped_storage()
    storage.resize_(0)  # as FSDP's reshard does
    storage.resize_(expected.numel() * expected.element_size())
    weight.copy_(expected)  # ... and its all-gather before backward
    y.sum().backward()
    assert torch.allclose(x.grad, ((x.detach() @ expected.t()) > 0).float() @ expected)
