"""GRPO's objective: completions of a prompt, sampled as a group of G by the policy, are scored by the rewards;
each completion's advantage is its reward's distance from its group's mean in units of the group's standard
deviation, and the policy's per-token log-probabilities are trained with PPO's clipped surrogate.

The variant is TRL 1.16's ``GRPOTrainer`` with its defaults (trl/trainer/grpo_trainer.py, ``_compute_loss`` and
``_generate_and_score_completions``): GRPO (Shao et al. 2024, DeepSeekMath, eq. 3) with the token-level
normalisation of DAPO (Yu et al. 2025, eq. 8; ``loss_type="dapo"``: the summed token losses of a step over its
completion tokens), or ``grpo`` (each completion's mean, then the mean over completions) or ``dr_grpo`` (Liu et al.
2025: the sum over completions times max_new_tokens); ``num_iterations=1``, so the "old" log-probabilities are the
current ones detached (the ratio is 1 and its gradient the policy gradient), clipping at 1 - epsilon and 1 +
epsilon_high (0.2 both); ``beta=0`` by default (no reference), else the k3 estimate of KL(policy || reference)
per token (Schulman 2020), as TRL; ``scale_rewards="group"``: advantages (r - mean_group) / (std_group + 1e-4),
std with Bessel's correction (TRL's ``nanstd``). tests/test_grpo.py holds the loss and its gradient to TRL's own
``_compute_loss``.

A batch is ``(input_ids, targets, advantages, weights, stats)``: rows of prompt + completion (targets IGNORE_INDEX
outside the completion), each row's advantage, its weight (what the loss type divides its summed token losses by,
folded in so that the step's division by its number of completions gives TRL's normalisation) and its rollout's
statistics (``ROLLOUT_METRICS`` and the rewards: logged, not trained). Log-probabilities come from the head a chunk
of tokens at a time (``token_log_probs``): a batch's vocabulary-wide logits never exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager, Optional

import torch
import torch.nn as nn

from lit_model.data.instruct import IGNORE_INDEX
from lit_model.methods.objective import Batch, LossSums, target_tokens, token_log_probs
from lit_model.methods.rewards import reward_names
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE

GRPO_LOSSES = ("dapo", "grpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclass(frozen=True)
class GRPOSpec:
    """A run's GRPO settings as resolved from its flags (``run.resolve_grpo``). ``reference``: "adapters" (LoRA's
    or LLaMA-Adapter's base, its adapters off) with ``beta > 0``, else "none"."""

    rewards: tuple[str, ...] = ("exact_match",)
    reward_weights: Optional[tuple[float, ...]] = None
    num_generations: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    scale_rewards: str = "group"
    reference: str = "none"

    @property
    def rollout_metrics(self) -> tuple[str, ...]:
        """What a rollout logs per completion (a batch's ``stats`` columns, in this order): TRL's names."""
        return ("reward", "reward_std", *(f"rewards/{name}" for name in reward_names(self.rewards)),
                "completion_length")

    @property
    def metric_names(self) -> tuple[str, ...]:
        return (*self.rollout_metrics, "clip_ratio", *(("kl",) if self.beta > 0 else ()))

    def rollout_rows(self, micro_batch_size: int) -> int:
        """The completions a rollout decodes at a time: as many whole groups as a training micro batch holds, at
        least one. Their KV cache is far smaller than the training step's activations over as many rows, so it
        raises no peak the step does not reach; and a small model's decoding step (bound by per-step overhead and
        reading the weights) costs little more for several groups than for one, so a step's rollouts take fewer."""
        return max(1, micro_batch_size // self.num_generations) * self.num_generations


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group") -> torch.Tensor:
    """TRL's advantages of ``rewards`` (completions,), consecutive groups of ``group`` completions of one prompt:
    the reward less its group's mean, over (the group's, or the whole batch's, std + 1e-4) unless ``scale`` is
    "none"."""
    grouped = rewards.view(-1, group)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return advantages
    if scale == "batch":
        std = torch.full_like(rewards, rewards.std().item() if rewards.numel() > 1 else 0.0)
    else:
        std = (grouped.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(grouped)).expand_as(grouped)
    return advantages / (std.reshape(-1) + STD_EPSILON)


def row_weights(loss_type: str, lengths: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """What each completion's summed token losses are multiplied by so that a step's loss, divided by its number
    of completions, is the loss type's: dapo, the step's completions over its completion tokens (every token
    weighs alike); grpo, 1 over the completion's own tokens; dr_grpo, 1 over max_new_tokens."""
    lengths = lengths.float()
    if loss_type == "dapo":
        return torch.full_like(lengths, lengths.numel() / lengths.sum().clamp(min=1).item())
    if loss_type == "grpo":
        return 1 / lengths.clamp(min=1)
    if loss_type == "dr_grpo":
        return torch.full_like(lengths, 1 / max_new_tokens)
    raise ValueError(f"loss_type {loss_type!r}: one of {GRPO_LOSSES}")


def token_losses(log_probs: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float,
                 beta: float = 0.0, ref_log_probs: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token (rows, time): the clipped surrogate's loss (plus beta times the KL estimate), whether the ratio was
    clipped, and the KL estimate (zeros with beta 0). ``log_probs`` the policy's, ``advantages`` (rows,)."""
    ratio = torch.exp(log_probs - log_probs.detach())  # num_iterations 1: the sampling policy is this one
    advantages = advantages.unsqueeze(1)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon_high) & (advantages > 0))
    kl = torch.zeros_like(log_probs)
    if beta != 0:
        delta = ref_log_probs - log_probs
        kl = torch.exp(delta) - delta - 1
        losses = losses + beta * kl
    return losses, clipped, kl


@dataclass(frozen=True)
class GRPO:
    """GRPO's objective (see the module's docstring); its count is the batch's completions. ``reference``: a
    context in which the model is the reference (LoRA's or LLaMA-Adapter's adapters off), needed when ``beta > 0``."""

    spec: GRPOSpec = GRPOSpec()
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    reference: Optional[Callable[[nn.Module], ContextManager]] = None
    differentiable_twice: bool = False

    @property
    def metric_names(self) -> tuple[str, ...]:
        return self.spec.metric_names

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(batch[0].size(0), device=batch[0].device)

    def tokens(self, batch: Batch) -> torch.Tensor:
        return target_tokens(batch)

    def example_batch(self, rows: int, seq_len: int, vocab_size: int) -> Batch:
        """``rows`` completions of ``seq_len`` tokens, every one a target (the longest a rollout may make)."""
        shape = (rows, seq_len)
        return (torch.randint(0, vocab_size, shape), torch.randint(0, vocab_size, shape), torch.randn(rows),
                torch.ones(rows), torch.zeros(rows, len(self.spec.rollout_metrics)))

    def loss_sum(self, model: nn.Module, batch: Batch) -> LossSums:
        input_ids, targets, advantages, weights, stats = batch
        readout = partial(token_log_probs, targets=targets, chunk_size=self.chunk_size)
        ref = None
        if self.spec.beta != 0:
            if self.reference is None:
                raise ValueError("beta > 0 needs the reference: a context in which the model is it")
            with torch.no_grad(), self.reference(model):  # before the policy's forward, as Preference's
                ref = model(input_ids, readout=readout)
        log_probs = model(input_ids, readout=readout)
        mask = (targets != IGNORE_INDEX).float()
        losses, clipped, kl = token_losses(log_probs, advantages.float(), self.spec.epsilon, self.spec.epsilon_high,
                                           self.spec.beta, ref)
        loss = ((losses * mask).sum(dim=1) * weights).sum()
        tokens = mask.sum(dim=1).clamp(min=1)
        # per completion, then summed: the fit loop logs them over the count (completions)
        metrics = dict(zip(self.spec.rollout_metrics, stats.float().sum(dim=0)))
        metrics["clip_ratio"] = ((clipped.float() * mask).sum(dim=1) / tokens).sum()
        if self.spec.beta > 0:
            metrics["kl"] = ((kl.detach() * mask).sum(dim=1) / tokens).sum()
        return LossSums(loss, self.count(batch), metrics)
