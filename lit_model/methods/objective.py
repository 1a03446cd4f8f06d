"""What a training step minimises: an objective turns a batch into a summed loss and the count it is averaged over
(``loss_sum(model, batch) -> LossSums(loss, count, metrics)``), with the sums of what it logs beside the loss. The step (train/step.py) calls only that, so a method that trains with
another objective (preference pairs, rollouts) brings its own, and the planner's trace, which runs the step, plans
it as it is.

The model stays a plain module: an objective hands ``GPT.forward`` a ``readout`` that turns the final hidden states
into what it needs (here the fused chunked cross-entropy, never the whole logits), inside the model's own forward, so
that Fabric's precision, FSDP's parameter gathering and DDP's hooks apply to it as to the rest of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, ClassVar, Mapping, NamedTuple, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_model.data.instruct import IGNORE_INDEX
from lit_model.model.gpt import GPT, plain_linear
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE, linear_cross_entropy

Batch = tuple[torch.Tensor, ...]


class LossSums(NamedTuple):
    """A batch's summed loss (differentiable), the count it is averaged over, and the sums of the objective's
    ``metric_names`` over the same count (detached): the fit loop logs each as its sum over the count."""

    loss: torch.Tensor
    count: torch.Tensor
    metrics: Mapping[str, torch.Tensor] = {}


class Objective(Protocol):
    # whether its loss can be differentiated twice (optimizers that estimate a Hessian need it)
    differentiable_twice: bool
    # what it logs beside the loss (LossSums.metrics' keys, in this order: metrics.csv's columns)
    metric_names: ClassVar[tuple[str, ...]]

    def count(self, batch: Batch) -> torch.Tensor:
        """What the batch's loss is averaged over (the step scales every micro batch by the whole step's count)."""

    def tokens(self, batch: Batch) -> torch.Tensor:
        """The batch's tokens the run counts (its progress and tokens per second): those with a target."""

    def loss_sum(self, model: nn.Module, batch: Batch) -> LossSums:
        """The batch's summed loss (differentiable), ``count(batch)`` and its metrics' sums."""

    def example_batch(self, rows: int, seq_len: int, vocab_size: int) -> Batch:
        """A batch of ``rows`` samples of ``seq_len`` tokens as this objective takes them (random tokens, every one a
        target): what the memory planner traces."""


def target_tokens(batch: Batch) -> torch.Tensor:
    """The number of tokens with a target in ``batch`` (input ids, targets, ...)."""
    return (batch[1] != IGNORE_INDEX).sum()


def mean_loss(objective: Objective, model: nn.Module, batch: Batch) -> torch.Tensor:
    """The batch's mean loss: its sum over its count (at least 1)."""
    sums = objective.loss_sum(model, batch)
    return sums.loss / sums.count.clamp(min=1)


@dataclass(frozen=True)
class CausalLM:
    """Next-token cross-entropy over ``(input_ids, targets)`` or packed samples ``(input_ids, targets, positions)``
    (targets of IGNORE_INDEX count for nothing), computed in fp32 ``chunk_size`` tokens at a time (0: all at once) so
    the (tokens x vocab) logits are never all alive. ``differentiable_twice``: for optimizers that differentiate the
    gradients again (Sophia's Hessian), which the fused loss cannot. ``packed``: see ``example_batch``."""

    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    differentiable_twice: bool = False
    packed: bool = False  # batches of packed samples carry each token's position (their documents' masks)
    # every chunk's logits recomputed in backward, even where the fused loss would run: for several losses over one
    # batch (a preference objective's rows), each of whose fused losses would keep the head's gradient (vocabulary x
    # embedding) until backward
    recompute_head: bool = False
    metric_names: ClassVar[tuple[str, ...]] = ()

    def count(self, batch: Batch) -> torch.Tensor:
        return target_tokens(batch)

    def tokens(self, batch: Batch) -> torch.Tensor:
        return target_tokens(batch)

    def example_batch(self, rows: int, seq_len: int, vocab_size: int) -> Batch:
        shape = (rows, seq_len)
        tokens = (torch.randint(0, vocab_size, shape), torch.randint(0, vocab_size, shape))
        return (*tokens, torch.zeros(shape, dtype=torch.long)) if self.packed else tokens

    def loss_sum(self, model: nn.Module, batch: Batch) -> LossSums:
        input_ids, targets, *positions = batch
        total = model(input_ids, positions=positions[0] if positions else None,
                      readout=partial(self.readout, targets=targets))
        return LossSums(total, self.count(batch))

    def readout(self, model: GPT, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of the final hidden states (batch, time, embedding) against ``targets``."""
        x, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        chunk = self.chunk_size if self.chunk_size > 0 else x.size(0)
        if plain_linear(model.lm_head) and not self.differentiable_twice and not self.recompute_head:
            return linear_cross_entropy(x, model.lm_head.weight, model.lm_head.bias, targets, chunk,
                                        model.config.final_logit_softcapping,
                                        onednn=model.kernel_policy.onednn_fp32_linear)
        # A head with adapters (LoRA), a double backward or recompute_head: checkpointed chunks, recomputed in backward.
        total = x.new_zeros((), dtype=torch.float32)
        for chunk_sum in over_chunks(partial(token_losses, reduction="sum"), model, x, targets, chunk,
                                     recompute=self.recompute_head):
            total = total + chunk_sum
        return total


def token_losses(model: GPT, x: torch.Tensor, targets: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """The head's fp32 cross-entropy of hidden states ``x`` (tokens, embedding) against ``targets``: per token (0
    where ignored), or summed."""
    return F.cross_entropy(model.head(x).float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def over_chunks(function: Callable[[GPT, torch.Tensor, torch.Tensor], torch.Tensor], model: GPT, x: torch.Tensor,
                targets: torch.Tensor, chunk: int, recompute: bool = False) -> list[torch.Tensor]:
    """``function(model, rows of x, their targets)`` ``chunk`` rows at a time; with gradients each chunk is
    checkpointed (its logits recomputed in backward) when there are several, or always with ``recompute``, so one
    chunk's (chunk x vocab) logits are alive at a time."""
    results = []
    for start in range(0, x.size(0), chunk):
        x_chunk, t_chunk = x[start : start + chunk], targets[start : start + chunk]
        if (recompute or chunk < x.size(0)) and torch.is_grad_enabled():
            results.append(checkpoint(function, model, x_chunk, t_chunk, use_reentrant=False))
        else:
            results.append(function(model, x_chunk, t_chunk))
    return results


def token_log_probs(model: GPT, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Each target's log-probability (batch, time), fp32, 0 where the target is IGNORE_INDEX: a ``GPT.forward``
    readout for objectives that weigh tokens one by one (GRPO). ``chunk_size`` rows of logits at a time
    (``over_chunks``): the (tokens x vocab) logits never exist whole."""
    x, flat = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    chunk = chunk_size if chunk_size > 0 else x.size(0)
    losses = over_chunks(token_losses, model, x, flat, chunk)
    return -torch.cat(losses).view(targets.shape)
