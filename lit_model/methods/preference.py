"""Preference objectives: DPO and its kin (IPO, SimPO, ORPO) train on pairs of completions of one prompt, the chosen
and the rejected, from each completion's log-probability under the policy (summed over its tokens, or averaged).

A batch is ``(input_ids, targets)`` of shape (pairs, 2, time), the chosen completion first, targets IGNORE_INDEX
outside the completion (prompt and padding); DPO and IPO also need the reference's log-probabilities, either in the
batch as a third part of shape (pairs, 2) (computed before training) or from the model itself with its adapters
switched off (``reference``: LoRA's or LLaMA-Adapter's base is the reference, no second model). The step splits a
batch by pairs, and the loss is averaged over pairs. Log-probabilities come from the head a chunk of tokens at a
time (checkpointed, recomputed in backward): the vocabulary-wide logits of a batch never exist. With --packing
(``pack_length``) a micro batch's rows are packed into rows of up to the run's length before the forward
(``pair_rows``), each attending only to itself, and each row's log-probability is summed over its own span of the
packed rows: the same values, fewer padding tokens computed (packed in the objective, not the loader, so the step
still splits a batch by pairs).

The losses and logged rewards are TRL's (``DPOTrainer`` loss_type "sigmoid" and "ipo", ``CPOTrainer`` "simpo",
``ORPOTrainer``): tests/test_preference.py holds them to TRL's own functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, ClassVar, ContextManager, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from lit_model.data.instruct import IGNORE_INDEX
from lit_model.data.preference import pack_rows
from lit_model.model.gpt import GPT
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.methods.objective import Batch, CausalLM, LossSums, target_tokens

PREFERENCE_LOSSES = ("dpo", "ipo", "simpo", "orpo")
# the losses that compare the policy with a reference (the others are reference-free)
WITH_REFERENCE = ("dpo", "ipo")
# the losses of log-probabilities averaged over the completion's tokens (TRL: IPO, SimPO, ORPO)
AVERAGED = ("ipo", "simpo", "orpo")
# what a preference objective logs, under TRL's names: sums over a batch's pairs (LossSums.metrics)
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
# where a row sits in packed rows: (packed row, offset, length)
Span = tuple[int, int, int]


def sequence_log_probs(model: GPT, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                       spans: Optional[list[Span]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed log-probability of each row's targets (rows, time) and each row's number of targets, from the
    final hidden states (rows, time, embedding): a readout of ``GPT.forward``. Each row's is the language-model
    loss's own chunked head and cross-entropy (``CausalLM.readout``; fused where the head is frozen) over that row,
    negated: a row's logits never exist whole. ``spans``: each row's
    place in packed hidden states (``pair_rows``), read in the same chunks from the row's first token."""
    spans = spans if spans is not None else [(row, 0, targets.size(1)) for row in range(targets.size(0))]
    # a trained head: each row's fused loss would keep a gradient of the head's weight until backward (rows x
    # vocabulary x embedding); its logits recomputed in backward keep the rows' hidden states only
    head_trains = torch.is_grad_enabled() and any(p.requires_grad for p in model.lm_head.parameters())
    language_model = CausalLM(chunk_size, recompute_head=head_trains)
    log_probs = torch.stack([-language_model.readout(model, hidden[at, start : start + length], targets[row, :length])
                             for row, (at, start, length) in enumerate(spans)])
    return log_probs, (targets != IGNORE_INDEX).sum(dim=1)


@dataclass(frozen=True)
class PairRows:
    """A batch's rows as the model reads them (``pair_rows``): ``targets`` (pairs * 2, time), chosen and rejected
    alternating; ``input_ids`` those rows, or packed rows with each token's ``positions`` and each row's ``spans``."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    positions: Optional[torch.Tensor] = None
    spans: Optional[list[Span]] = None

    def log_probs(self, model: nn.Module, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``sequence_log_probs`` of every row under ``model``."""
        readout = partial(sequence_log_probs, targets=self.targets, chunk_size=chunk_size, spans=self.spans)
        return model(self.input_ids, positions=self.positions, readout=readout)


def completion_ends(targets: torch.Tensor) -> list[int]:
    """Each row's length up to its last target (what follows cannot change its log-probabilities); a host sync. The
    planner's example rows are fake tensors, without values, whose every token is a target (``example_batch``)."""
    if is_fake(targets):
        return [targets.size(1)] * targets.size(0)
    last = (targets != IGNORE_INDEX).flip(1).int().argmax(dim=1)
    return (targets.size(1) - last).tolist()


def pair_rows(batch: Batch, pack_length: Optional[int] = None) -> PairRows:
    """The batch's (pairs, 2, time) rows; with ``pack_length`` (--packing) packed into rows of at most that many
    tokens as ``pack_rows`` places them, each row cut after its last target and its positions counting from 0 (a
    document of its own: ``GPT.forward``; a padding token is one too)."""
    input_ids, targets = batch[0].flatten(0, 1), batch[1].flatten(0, 1)
    if pack_length is None:
        return PairRows(input_ids, targets)
    ends = completion_ends(targets)
    packs, width = pack_rows(ends, pack_length)
    packed = input_ids.new_zeros(len(packs), width)
    positions = torch.zeros(len(packs), width, dtype=torch.long)  # made here, moved once
    spans: list[Span] = [(0, 0, 0)] * len(ends)
    for index, pack in enumerate(packs):
        start = 0
        for row in pack:
            packed[index, start : start + ends[row]] = input_ids[row, : ends[row]]
            positions[index, start : start + ends[row]] = torch.arange(ends[row])
            spans[row] = (index, start, ends[row])
            start += ends[row]
    return PairRows(packed, targets, positions.to(input_ids.device), spans)


@torch.no_grad()
def reference_log_probs(model: nn.Module, batches: Iterable[Batch], chunk_size: int,
                        pack_length: Optional[int] = None) -> torch.Tensor:
    """The summed log-probabilities (pairs, 2) of every pair's completions under ``model``, the reference, in the
    batches' order (batches as ``Preference.loss_sum`` takes them, packed alike): computed once, before training."""
    return torch.cat([pair_rows(batch, pack_length).log_probs(model, chunk_size)[0].float().view(-1, 2).cpu()
                      for batch in batches])


def pair_losses(loss: str, beta: float, log_probs: torch.Tensor, lengths: torch.Tensor,
                ref_log_probs: Optional[torch.Tensor], simpo_gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss and its (chosen, rejected) rewards, detached, from the summed log-probabilities of its two
    completions (pairs, 2), their target counts and the reference's (WITH_REFERENCE losses). As TRL: DPO's and IPO's
    rewards are beta times the summed log-ratios, SimPO's and ORPO's beta times the averaged log-probabilities."""
    average = log_probs / lengths.clamp(min=1)
    if loss in WITH_REFERENCE:
        ratio = log_probs - ref_log_probs
        if loss == "dpo":  # DPO (Rafailov et al. 2023, eq. 7)
            losses = -F.logsigmoid(beta * (ratio[:, 0] - ratio[:, 1]))
        else:  # IPO (Azar et al. 2023, eq. 17) on log-ratios averaged over the tokens, as TRL
            averaged = ratio / lengths.clamp(min=1)
            losses = (averaged[:, 0] - averaged[:, 1] - 1 / (2 * beta)) ** 2
        return losses, beta * ratio.detach()
    chosen, rejected = average[:, 0], average[:, 1]
    if loss == "simpo":  # SimPO (Meng et al. 2024, eq. 6): reference-free, with a target margin gamma
        losses = -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
    elif loss == "orpo":  # ORPO (Hong et al. 2024, eq. 6-7): the chosen completion's NLL plus the odds-ratio term
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        losses = -chosen - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"loss {loss!r}: one of {PREFERENCE_LOSSES}")
    return losses, beta * average.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Mächler 2012), as TRL's."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass(frozen=True)
class PreferenceSpec:
    """A run's preference objective as resolved from its flags: the loss and its parameters, and where the
    reference's log-probabilities come from ("adapters": the model with its adapters off; "precomputed": the
    batches; "none": a reference-free loss)."""

    loss: str = "dpo"
    beta: float = 0.1
    simpo_gamma: float = 0.5
    reference: str = "adapters"


@dataclass(frozen=True)
class Preference:
    """A preference objective (``loss`` one of PREFERENCE_LOSSES, TRL's defaults). ``reference``: a context in which
    the model is the reference (LoRA's or LLaMA-Adapter's adapters off, ``lora.adapters_disabled``); None: the
    reference's log-probabilities come in the batch (or the loss needs none)."""

    loss: str = "dpo"
    beta: float = 0.1
    simpo_gamma: float = 0.5
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    reference: Optional[Callable[[nn.Module], ContextManager]] = None
    pack_length: Optional[int] = None  # --packing: a micro batch's rows packed into rows of at most this many tokens
    differentiable_twice: bool = False
    metric_names: ClassVar[tuple[str, ...]] = PREFERENCE_METRICS

    # the reference's log-probabilities come in the batches (example_batch makes them)
    precomputed_reference: bool = False

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(batch[0].size(0), device=batch[0].device)

    def tokens(self, batch: Batch) -> torch.Tensor:
        return target_tokens(batch)

    def example_batch(self, rows: int, seq_len: int, vocab_size: int) -> Batch:
        """``rows`` pairs of completions of ``seq_len`` tokens each."""
        shape = (rows, 2, seq_len)
        tokens = (torch.randint(0, vocab_size, shape), torch.randint(0, vocab_size, shape))
        return (*tokens, torch.zeros(rows, 2)) if self.precomputed_reference else tokens

    def loss_sum(self, model: nn.Module, batch: Batch) -> LossSums:
        rows = pair_rows(batch, self.pack_length)  # packed once, read by the reference and the policy
        ref = None
        if self.loss in WITH_REFERENCE:
            if len(batch) > 2:
                ref = batch[2].reshape(-1, 2).float()
            elif self.reference is not None:
                # before the policy's forward: its transient tensors are freed before the policy's activations are
                # made, so they never add to them (and the heap reuses their memory)
                with torch.no_grad(), self.reference(model):
                    ref = rows.log_probs(model, self.chunk_size)[0].view(-1, 2)
            else:
                raise ValueError(f"{self.loss} needs the reference's log-probabilities: in the batch or a reference")
        log_probs, lengths = rows.log_probs(model, self.chunk_size)
        losses, rewards = pair_losses(self.loss, self.beta, log_probs.view(-1, 2), lengths.view(-1, 2), ref,
                                      self.simpo_gamma)
        chosen, rejected = rewards.unbind(1)
        sums = (chosen.sum(), rejected.sum(), (chosen > rejected).sum().float(), (chosen - rejected).sum())
        return LossSums(losses.sum(), self.count(batch), dict(zip(PREFERENCE_METRICS, sums)))
