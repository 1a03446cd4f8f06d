"""GRPO's rollouts, generated in the training process by the continuous-batching engine with the training weights
themselves (LoRA's adapters on their shared base, no copy): R completions decode at a time (as many whole groups of
G as a micro batch holds: ``GRPOSpec.rollout_rows``) in a paged KV cache of R x (the longest prompt +
--max_new_tokens) positions, allocated for the rollout and removed before anything else runs, so it never adds to
the training step's memory. The completions are decoded, scored by the rewards and
turned into a training batch (``methods/grpo.py``'s layout).

Rollouts are seeded per (run seed, step, rank, prompt, completion): the same run draws the same completions, and a
resumed one those the uninterrupted run would have drawn from the same weights.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from lit_model.data.instruct import IGNORE_INDEX, padded_length
from lit_model.data.prompts import Prompt
from lit_model.data.text import GlobalBatchSampler
from lit_model.core.errors import UserError
from lit_model.core.meter import Meter
from lit_model.infer.batching import Engine, Request, complete
from lit_model.infer.engine import Sampling
from lit_model.infer.load import Precision
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE, PoolSpec, blocks_for
from lit_model.methods.grpo import GRPOSpec, group_advantages, row_weights
from lit_model.methods.objective import Batch
from lit_model.methods.rewards import Reward, score
from lit_model.model.gpt import GPT


VALIDATION = 1 << 40  # the "step" of the validation rollouts' seeds: never a training step


# Rollout rows are padded to a multiple of 8 tokens, not the instruction batches' 64: a step's prompts and
# completions vary in length, and padding 197 tokens to 256 would train on 30 % padding.
ROW_MULTIPLE = 8


def row_length(tokens: int, seq_len: int) -> int:
    """The length a batch of rollout rows whose longest has ``tokens`` input tokens is padded to (at most
    ``seq_len``): what the rehearsal sizes its batch by."""
    return padded_length(tokens, ROW_MULTIPLE, seq_len)


def rollout_seed(*keys: int) -> int:
    """A sampling seed for ``keys`` (run seed, step, rank, prompt), independent for every combination."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


class Rollouts:
    """Generates and scores groups of completions with ``model`` (the bare ``GPT`` that training updates) and
    returns them as a training batch on ``device``. ``announce`` (if given) hears one line per call. ``rows``: the
    completions decoded at a time (``GRPOSpec.rollout_rows``; default one group)."""

    def __init__(self, model: GPT, tokenizer: Any, precision: Precision, spec: GRPOSpec, rewards: Sequence[Reward],
                 weights: torch.Tensor, seq_len: int, device: torch.device,
                 announce: Optional[Callable[[str], Any]] = None, rows: Optional[int] = None) -> None:
        self.model, self.tokenizer, self.precision, self.spec = model, tokenizer, precision, spec
        self.rewards, self.weights, self.seq_len, self.device, self.announce = rewards, weights, seq_len, device, announce
        self.rows_at_a_time = rows or spec.num_generations

    def generate(self, prompts: Sequence[Prompt], seeds: Sequence[int]) -> list[list[int]]:
        """G completions' token ids per prompt (the eos that ended one kept: the policy is trained to stop), in
        eval mode and without gradients, through the continuous-batching engine: R (``rows``) sequences decode at a
        time in a pool of R x (the longest prompt + --max_new_tokens) positions (a group sharing its prompt's blocks),
        others joining as some end; a step that runs out of memory gives the newest sequences' blocks back and
        recomputes them later. The cache is removed afterwards, whatever happens."""
        spec, model, group = self.spec, self.model, self.spec.num_generations
        rows = min(self.rows_at_a_time, group * len(prompts))  # an evaluation's single group: no larger pool
        longest = max(len(prompt.ids) for prompt in prompts) + spec.max_new_tokens
        requests = [Request(f"{i}.{g}", tuple(int(t) for t in prompt.ids), spec.max_new_tokens,
                            Sampling(spec.temperature, spec.top_k, spec.top_p, rollout_seed(seed, g)),
                            tuple(self.tokenizer.eos_ids))
                    for i, (prompt, seed) in enumerate(zip(prompts, seeds)) for g in range(group)]
        was_training = model.training
        model.eval()
        try:
            # a group's completions share their prompt's full blocks (prefix caching): the prompt is computed once;
            # the engine lives for this rollout only, so no block outlives the weights it was computed with
            engine = Engine(model, self.precision, PoolSpec(rows * blocks_for(longest, DEFAULT_BLOCK_SIZE)), rows,
                            prefix_caching=True)
            done, _ = complete(engine, requests)
        finally:
            model.clear_kv_cache()
            model.train(was_training)
        failed = next((done[r.id].error for r in requests if done[r.id].finish_reason == "error"), None)
        if failed is not None:
            raise UserError(f"A rollout failed: {failed} Lower --max_new_tokens or --num_generations, or load the "
                            "base weights in 4 bits with --quantize bnb.nf4.")
        eos = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
        return [list(done[r.id].tokens) + (eos if done[r.id].finish_reason == "stop" else []) for r in requests]

    def __call__(self, prompts: Sequence[Prompt], seeds: Sequence[int], announce: bool = True,
                 meter: Optional[Meter] = None) -> Batch:
        """The batch of ``prompts``' completions: (input_ids, targets, advantages, weights, stats), G rows per prompt
        in the prompts' order; ``announce``: tell ``self.announce`` how it went; ``meter``: add the rollout's prompt +
        completion tokens and its seconds (generation, rewards and the batch) to it."""
        start = time.perf_counter()
        completion_ids = self.generate(prompts, seeds)
        seconds = time.perf_counter() - start
        group = self.spec.num_generations
        rows = [p for p in prompts for _ in range(group)]
        eos = set(self.tokenizer.eos_ids)
        texts = [self.tokenizer.decode([t for t in ids if t not in eos]) for ids in completion_ids]
        # as TRL hands them over: a conversational prompt's completions as assistant messages
        completions = [[{"role": "assistant", "content": text}] if isinstance(p.prompt, list) else text
                       for p, text in zip(rows, texts)]
        keys = sorted({key for p in prompts for key in p.fields})
        fields = {key: [p.fields.get(key) for p in rows] for key in keys}
        per_reward = score(self.rewards, [p.prompt for p in rows], completions, {**fields, "completion_ids": completion_ids})
        rewards = per_reward @ self.weights
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float32)
        std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
        stats = torch.cat([rewards[:, None], std.expand(len(rows), 1), per_reward, lengths[:, None]], dim=1)
        if announce and self.announce is not None:
            self.announce(f"Rollout: {len(prompts)} prompt(s) x {group} completions, {int(lengths.sum())} tokens in "
                          f"{seconds:.1f} s ({lengths.sum().item() / max(seconds, 1e-9):,.0f} tok/s), reward "
                          f"{rewards.mean().item():.3f} (std {std.item():.3f})")
        input_ids, targets = self.rows([p.ids for p in rows], completion_ids)
        batch = (input_ids, targets, group_advantages(rewards, group, self.spec.scale_rewards),
                 row_weights(self.spec.loss_type, lengths, self.spec.max_new_tokens), stats)
        batch = tuple(part.to(self.device) for part in batch)
        if meter is not None:
            meter.add(sum(len(p.ids) for p in rows) + int(lengths.sum()), time.perf_counter() - start)
        return batch

    def rows(self, prompt_ids: Sequence[np.ndarray], completion_ids: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and targets of prompt + completion rows, right-padded: the completion's tokens the only targets."""
        sequences = [np.concatenate([p, np.asarray(c, dtype=np.int64)]) for p, c in zip(prompt_ids, completion_ids)]
        length = row_length(max(len(s) for s in sequences) - 1, self.seq_len)
        input_ids = torch.zeros(len(sequences), length, dtype=torch.long)
        targets = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
        for row, (sequence, prompt) in enumerate(zip(sequences, prompt_ids)):
            input_ids[row, : len(sequence) - 1] = torch.from_numpy(sequence[:-1])
            targets[row, len(prompt) - 1 : len(sequence) - 1] = torch.from_numpy(sequence[len(prompt):])
        return input_ids, targets


def train_rollouts(rollouts: Rollouts, prompts: Sequence[Prompt], prompts_per_step: int, micro_batch_size: int,
                   rank: int, world_size: int, seed: int, start_step: int, meter: Optional[Meter] = None) -> Iterator[Batch]:
    """An endless iterator of this rank's micro batches from optimizer step ``start_step`` on: each step's prompts
    (``GlobalBatchSampler``: the same for any world size, resumable by step) are rolled out when its first micro
    batch is asked for, then handed out ``micro_batch_size`` completions at a time. ``meter`` hears each rollout's
    tokens and seconds."""
    per_rank = prompts_per_step // world_size
    sampler = GlobalBatchSampler(len(prompts), prompts_per_step, per_rank, rank, world_size, seed, start_step)
    for step, indices in enumerate(sampler, start_step):
        batch = rollouts([prompts[i] for i in indices], [rollout_seed(seed, step, rank, i) for i in indices], meter=meter)
        yield from zip(*(part.split(micro_batch_size) for part in batch))


class EvaluationRollouts:
    """The validation prompts' rollouts as evaluation batches, one prompt's group each: generated anew with the
    current weights every time they are iterated (every evaluation), from the same seeds, so the validation reward
    follows the policy."""

    def __init__(self, rollouts: Rollouts, prompts: Sequence[Prompt], seed: int) -> None:
        self.rollouts, self.prompts, self.seed = rollouts, prompts, seed

    def __iter__(self) -> Iterator[Batch]:
        for index, prompt in enumerate(self.prompts):
            yield self.rollouts([prompt], [rollout_seed(self.seed, VALIDATION, index)], announce=False)
