"""``ParallelDims``: how a run's processes share the model, resolved once from the flags.

``--strategy``, ``--devices``, ``--num_nodes``, ``--cpu_offload`` and ``--sharding_strategy`` become a layout here and
nowhere else; everything downstream (the Fabric strategy, FSDP's mesh, the planner, the summary) reads its
properties. Tensor and context parallelism have no flags yet: ``tp`` and ``cp`` stay 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_model.core.errors import UsageError

STRATEGY_NAMES = ("single", "ddp", "fsdp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int  # data-parallel replicas (DDP's processes; HYBRID_SHARD's nodes)
    dp_shard: int  # processes each replica's parameters are sharded over (FSDP)
    tp: int = 1
    cp: int = 1
    # FSDP's machinery, also with one shard (on one device --cpu_offload needs it)
    fsdp: bool = False
    # --sharding_strategy as given: it only acts under FSDP, and a suggestion to switch to FSDP keeps it
    sharding_strategy: str = "FULL_SHARD"
    cpu_offload: bool = False  # FSDP keeps parameters, gradients and optimizer state in host memory

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def ddp(self) -> bool:
        """Whole replicas whose gradients DDP all-reduces."""
        return not self.fsdp and self.dp_replicate > 1

    @property
    def single(self) -> bool:
        return not self.fsdp and self.world_size == 1

    @property
    def hybrid(self) -> bool:
        """FSDP within a node, replicas across nodes: a two-dimensional mesh (dp_replicate, dp_shard)."""
        return self.fsdp and self.sharding_strategy == "HYBRID_SHARD"

    @property
    def reshards_after_forward(self) -> bool:
        """SHARD_GRAD_OP keeps the gathered parameters from forward until backward: less communication, more memory."""
        return self.sharding_strategy != "SHARD_GRAD_OP"

    @property
    def strategy_name(self) -> str:
        """"single", "ddp" or "fsdp": the name reports, plans and summary.json give the layout."""
        return "fsdp" if self.fsdp else ("ddp" if self.ddp else "single")


def resolve_parallel_dims(strategy: str, devices: int, num_nodes: int, cpu_offload: bool,
                          sharding_strategy: str) -> ParallelDims:
    """The layout of ``devices`` processes on each of ``num_nodes`` nodes that ``--strategy`` (auto, ddp or fsdp),
    ``--cpu_offload`` and ``--sharding_strategy`` ask for."""
    world_size = devices * num_nodes
    if strategy == "auto":
        # Offload needs FSDP's machinery even on one device; several processes replicate with DDP.
        strategy = "fsdp" if cpu_offload else ("ddp" if world_size > 1 else "single")
    if strategy == "ddp" and world_size == 1:
        strategy = "single"
    if strategy not in STRATEGY_NAMES:
        raise UsageError(f"Unknown --strategy {strategy!r}: use auto, ddp or fsdp.")
    if cpu_offload and strategy != "fsdp":
        raise UsageError(
            f"--cpu_offload works through FSDP, not --strategy {strategy}. Use --strategy fsdp (or auto) "
            "with --cpu_offload, or drop --cpu_offload."
        )
    if sharding_strategy == "HYBRID_SHARD" and num_nodes < 2:
        raise UsageError(
            "--sharding_strategy HYBRID_SHARD shards within a node and replicates across nodes, so it needs "
            "--num_nodes >= 2. Use FULL_SHARD or SHARD_GRAD_OP on one node."
        )
    fsdp = strategy == "fsdp"
    if not fsdp:
        replicate, shard = world_size, 1
    elif sharding_strategy == "HYBRID_SHARD":
        replicate, shard = num_nodes, devices
    else:
        replicate, shard = 1, world_size
    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, fsdp=fsdp, sharding_strategy=sharding_strategy,
                        cpu_offload=bool(cpu_offload))
    if dims.world_size != world_size:
        raise UsageError(f"The parallel layout (data-parallel replicas {dims.dp_replicate} x shards {dims.dp_shard} x "
                         f"tensor {dims.tp} x context {dims.cp}) needs {dims.world_size} processes, but --devices "
                         f"{devices} on --num_nodes {num_nodes} start {world_size}: make them agree.")
    return dims
