"""The parallel layout: --strategy, --devices, --num_nodes, --cpu_offload and --sharding_strategy resolved once into
``ParallelDims``, the refusals, and the Fabric strategy the backend builds for each layout."""

from __future__ import annotations

import datetime

import pytest
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lit_model.core.errors import UsageError
from lit_model.parallel.apply import Levers
from lit_model.parallel.backend import fabric_strategy
from lit_model.parallel.dims import ParallelDims, resolve_parallel_dims

# (strategy, devices, num_nodes, cpu_offload, sharding_strategy) -> (dp_replicate, dp_shard, fsdp, strategy_name)
TABLE = [
    (("auto", 1, 1, False, "FULL_SHARD"), (1, 1, False, "single")),
    (("auto", 4, 1, False, "FULL_SHARD"), (4, 1, False, "ddp")),
    (("auto", 2, 2, False, "FULL_SHARD"), (4, 1, False, "ddp")),
    (("auto", 1, 1, True, "FULL_SHARD"), (1, 1, True, "fsdp")),  # offload needs FSDP, even on one device
    (("auto", 4, 1, True, "FULL_SHARD"), (1, 4, True, "fsdp")),
    (("ddp", 1, 1, False, "FULL_SHARD"), (1, 1, False, "single")),  # DDP of one process is one device
    (("ddp", 2, 1, False, "FULL_SHARD"), (2, 1, False, "ddp")),
    (("ddp", 2, 2, False, "HYBRID_SHARD"), (4, 1, False, "ddp")),  # the sharding mode acts under FSDP only
    (("fsdp", 1, 1, False, "FULL_SHARD"), (1, 1, True, "fsdp")),
    (("fsdp", 4, 1, False, "SHARD_GRAD_OP"), (1, 4, True, "fsdp")),
    (("fsdp", 4, 1, True, "FULL_SHARD"), (1, 4, True, "fsdp")),
    (("fsdp", 2, 2, False, "FULL_SHARD"), (1, 4, True, "fsdp")),
    (("fsdp", 2, 3, False, "HYBRID_SHARD"), (3, 2, True, "fsdp")),  # replicas across nodes, shards within one
    (("auto", 4, 2, True, "HYBRID_SHARD"), (2, 4, True, "fsdp")),
]


@pytest.mark.parametrize("flags, expected", TABLE)
def test_the_flags_resolve_to_one_layout(flags, expected):
    strategy, devices, num_nodes, cpu_offload, sharding_strategy = flags
    dims = resolve_parallel_dims(*flags)
    dp_replicate, dp_shard, fsdp, name = expected
    assert dims == ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=1, cp=1, fsdp=fsdp,
                                sharding_strategy=sharding_strategy, cpu_offload=cpu_offload)
    assert dims.world_size == devices * num_nodes
    assert dims.strategy_name == name
    assert (dims.single, dims.ddp, dims.fsdp) == (name == "single", name == "ddp", name == "fsdp")
    assert dims.hybrid == (fsdp and sharding_strategy == "HYBRID_SHARD")
    assert dims.reshards_after_forward == (sharding_strategy != "SHARD_GRAD_OP")


@pytest.mark.parametrize("flags, message", [
    (("zero3", 2, 1, False, "FULL_SHARD"), "Unknown --strategy 'zero3': use auto, ddp or fsdp."),
    (("ddp", 2, 1, True, "FULL_SHARD"),
     "--cpu_offload works through FSDP, not --strategy ddp. Use --strategy fsdp (or auto) with --cpu_offload, or "
     "drop --cpu_offload."),
    (("ddp", 1, 1, True, "FULL_SHARD"),
     "--cpu_offload works through FSDP, not --strategy single. Use --strategy fsdp (or auto) with --cpu_offload, or "
     "drop --cpu_offload."),
    (("fsdp", 4, 1, False, "HYBRID_SHARD"),
     "--sharding_strategy HYBRID_SHARD shards within a node and replicates across nodes, so it needs --num_nodes >= 2. "
     "Use FULL_SHARD or SHARD_GRAD_OP on one node."),
    (("auto", 1, 1, False, "HYBRID_SHARD"),
     "--sharding_strategy HYBRID_SHARD shards within a node and replicates across nodes, so it needs --num_nodes >= 2. "
     "Use FULL_SHARD or SHARD_GRAD_OP on one node."),
])
def test_refused_layouts_name_the_fix(flags, message):
    with pytest.raises(UsageError) as error:
        resolve_parallel_dims(*flags)
    assert str(error.value) == message


@pytest.mark.parametrize("flags, strategy_class", [
    (("auto", 1, 1, False, "FULL_SHARD"), SingleDeviceStrategy),
    (("ddp", 2, 1, False, "FULL_SHARD"), DDPStrategy),
    (("auto", 1, 1, True, "FULL_SHARD"), ModelParallelStrategy),
    (("fsdp", 2, 2, False, "HYBRID_SHARD"), ModelParallelStrategy),
])
def test_the_backend_builds_the_fabric_strategy_of_the_layout(flags, strategy_class):
    timeout = datetime.timedelta(seconds=60)
    strategy = fabric_strategy(resolve_parallel_dims(*flags), Levers(), "cpu", timeout)
    assert type(strategy) is strategy_class
    if strategy_class is SingleDeviceStrategy:
        assert str(strategy.root_device) == "cpu"
    else:
        assert strategy._process_group_backend == "gloo" and strategy._timeout == timeout
    if strategy_class is ModelParallelStrategy:  # FSDP over every process: one data-parallel dimension
        assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (resolve_parallel_dims(*flags).world_size, 1)
