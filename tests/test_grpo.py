"""GRPO (finetune/grpo.py): the loss and its gradient against TRL's own GRPOTrainer._compute_loss, TRL's group
advantages, the per-token readout, rewards from files and built-ins (and one paragraph for each bad one), rollouts
that leave no KV cache behind, an end-to-end run that is reproducible and resumes exactly, LLaMA-Adapter with its
reference, and the plan."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, read_metrics
from test_finetune import MODEL, make_checkpoint, run

from lit_model.core.errors import UserError
from lit_model.data.instruct import IGNORE_INDEX
from lit_model.methods.grpo import GRPO, GRPOSpec, group_advantages, row_weights
from lit_model.train.loop import ROLLOUT_COLUMNS

REWARDS_FILE = '''
def short(prompts, completions, completion_ids, answer, **fields):
    assert len(prompts) == len(completions) == len(answer)
    return [1.0 / (1 + len(ids)) for ids in completion_ids]

def raises(prompts, completions, **fields):
    raise KeyError("no such thing")

def one_short(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)

def text(prompts, completions, **fields):
    return ["1"] * len(completions)

def nan(prompts, completions, **fields):
    return [float("nan")] * len(completions)
'''


# ---- the loss against TRL's ----------------------------------------------------------------------------------
class PerTokenModel(torch.nn.Module):
    """Stands in for the GPT: its forward hands back fixed per-token log-probabilities (the policy's, or inside
    ``reference`` the reference's), as the readout would."""

    def __init__(self, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs, self.ref_log_probs, self.as_reference = log_probs, ref_log_probs, False

    def forward(self, input_ids, readout):
        return self.ref_log_probs if self.as_reference else self.log_probs


@contextlib.contextmanager
def as_reference(model):
    model.as_reference = True
    try:
        yield
    finally:
        model.as_reference = False


def trl_loss(loss_type: str, log_probs: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             beta: float, epsilon: float, epsilon_high: float) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._compute_loss itself, on one process without gradient accumulation (one generation
    batch a step, as ours), its model's forward replaced by the given per-token log-probabilities."""
    from trl import GRPOTrainer

    rows, time = mask.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (log_probs, torch.zeros_like(log_probs), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), loss_type=loss_type,
        epsilon_low=epsilon, epsilon_high=epsilon_high, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=time, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x))
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1),
              "completion_ids": torch.zeros(rows, time, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "num_items_in_batch": mask.sum(), "ref_per_token_logps": ref}
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_equal_trls(loss_type, beta):
    torch.manual_seed(0)
    rows, time = 6, 7
    log_probs = (-torch.rand(rows, time, dtype=torch.float64) * 3).requires_grad_()
    ref = log_probs.detach() + 0.3 * torch.randn(rows, time, dtype=torch.float64)
    mask = torch.ones(rows, time)
    for row, length in enumerate([7, 3, 5, 1, 6, 2]):
        mask[row, length:] = 0
    advantages = torch.randn(rows, dtype=torch.float64)
    spec = GRPOSpec(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, max_new_tokens=time)

    expected = trl_loss(loss_type, log_probs, ref, advantages, mask.double(), beta, 0.2, 0.28)
    (expected_grad,) = torch.autograd.grad(expected, log_probs)

    targets = torch.where(mask.bool(), torch.ones(rows, time, dtype=torch.long), IGNORE_INDEX)
    batch = (torch.zeros(rows, time, dtype=torch.long), targets, advantages,
             row_weights(loss_type, mask.sum(dim=1), time).double(), torch.zeros(rows, len(spec.rollout_metrics)))
    objective = GRPO(spec, reference=as_reference)
    sums = objective.loss_sum(PerTokenModel(log_probs, ref), batch)
    loss = sums.loss / sums.count  # what the training step minimises: the sum over the step's count
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    assert grad.abs().sum() > 0  # the ratio is 1, its gradient the policy gradient
    assert sums.metrics["clip_ratio"].item() == 0  # num_iterations 1: nothing to clip
    if beta:
        masked = (mask.double() * (torch.exp(ref - log_probs) - (ref - log_probs) - 1)).detach()
        assert sums.metrics["kl"].item() == pytest.approx((masked.sum(1) / mask.sum(1)).sum().item(), rel=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls_group_normalised_ones(scale):
    from trl.trainer.utils import nanstd

    torch.manual_seed(1)
    rewards, group = torch.randn(12), 4
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    std = {"group": nanstd(grouped, dim=1).repeat_interleave(group), "batch": nanstd(rewards).expand_as(rewards),
           "none": None}[scale]  # grpo_trainer.py, _generate_and_score_completions ("sum_then_normalize")
    expected = rewards - mean if std is None else (rewards - mean) / (std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, group, scale), expected)
    # a group whose rewards are all alike teaches nothing
    assert group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2).tolist()[:2] == [0.0, 0.0]


def test_token_log_probs_are_the_logits_log_softmax_a_chunk_at_a_time():
    from lit_model import GPT, Config
    from lit_model.methods.objective import token_log_probs

    torch.manual_seed(0)
    model = GPT(Config(**{**MODEL, "block_size": 32}))
    model.init_weights()
    input_ids = torch.randint(0, 512, (3, 16))
    targets = torch.randint(0, 512, (3, 16))
    targets[:, :5] = IGNORE_INDEX
    got = model(input_ids, readout=lambda m, h: token_log_probs(m, h, targets, chunk_size=7))
    logits = model(input_ids).log_softmax(dim=-1)
    expected = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (targets != IGNORE_INDEX)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---- rewards -------------------------------------------------------------------------------------------------
def test_rewards_from_a_file_and_built_ins_are_weighted_and_summed(tmp_path):
    from lit_model.methods.rewards import load_rewards, score

    (tmp_path / "rewards.py").write_text(REWARDS_FILE)
    rewards, weights = load_rewards([f"{tmp_path}/rewards.py:short", "exact_match", r"format:^\d+$", "length"],
                                    [1.0, 2.0, 0.5, -0.1])
    assert [r.name for r in rewards] == ["short", "exact_match", "format", "length"]
    completions = [" 7 ", "seven", "12"]
    fields = {"answer": ["7", "7", "3"], "completion_ids": [[5, 6], [1, 2, 3, 4], [9]]}
    values = score(rewards, ["p"] * 3, completions, fields)
    expected = torch.tensor([[1 / 3, 1.0, 0.0, 2.0], [1 / 5, 0.0, 0.0, 4.0], [1 / 2, 0.0, 1.0, 1.0]])
    torch.testing.assert_close(values, expected)
    torch.testing.assert_close(values @ weights, expected @ torch.tensor([1.0, 2.0, 0.5, -0.1]))


@pytest.mark.parametrize("function, needle", [
    ("raises", "The reward 'raises' raised KeyError: 'no such thing'"),
    ("one_short", "The reward 'one_short' returned 2 values for 3 completions"),
    ("text", "The reward 'text' returned '1' among its values"),
    ("nan", "The reward 'nan' returned nan among its values"),
])
def test_a_reward_that_fails_is_named(tmp_path, function, needle):
    from lit_model.methods.rewards import load_rewards, score

    (tmp_path / "rewards.py").write_text(REWARDS_FILE)
    rewards, _ = load_rewards([f"{tmp_path}/rewards.py:{function}"], None)
    with pytest.raises(UserError) as error:
        score(rewards, ["p"] * 3, ["a", "b", "c"], {"completion_ids": [[1]] * 3})
    assert needle in str(error.value) and type(error.value) is UserError  # exit 1


# ---- the tiny model end to end -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> dict[str, Path]:
    """A tiny checkpoint, 30 addition prompts with their answers and a file of rewards."""
    from lit_model.io.tokenizer import train_bpe
    from conftest import STDLIB

    root = tmp_path_factory.mktemp("grpo")
    train_bpe([STDLIB / f"{n}.py" for n in ("textwrap", "shlex", "fnmatch", "string")], 512, root / "tokenizer")
    make_checkpoint(root / "base", root / "tokenizer")
    records = [{"prompt": f"Add {a} and {b}.", "answer": str(a + b), "a": a} for a in range(6) for b in range(5)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "rewards.py").write_text(REWARDS_FILE)
    return {"root": root, "base": root / "base", "data": root / "prompts.jsonl", "cache": root / "cache",
            "rewards": root / "rewards.py"}


def grpo_args(prompts: dict[str, Path], out_dir: Path, *extra: str) -> list:
    return ["--checkpoint_dir", prompts["base"], "--data_path", prompts["data"], "--out_dir", out_dir,
            "--micro_batch_size", "4", "--global_batch_size", "8", "--max_steps", "3", "--log_interval", "1",
            "--eval_interval", "3", "--eval_iters", "2", "--warmup_steps", "1", "--learning_rate", "0.01",
            "--val_split_fraction", "0.1", "--max_new_tokens", "6", "--lora_dropout", "0",
            "--reward", "exact_match", "--reward", "format:[aeiou]", "--reward", f"{prompts['rewards']}:short",
            "--reward_weights", "[1.0, 0.5, 1.0]", *extra]


def grpo(prompts: dict[str, Path], out_dir: Path, *extra: str):
    return run("finetune/grpo.py", *grpo_args(prompts, out_dir, *extra), cache=prompts["cache"])


def without_timing(out_dir: Path) -> list[dict[str, str]]:
    timing = {"tokens_per_sec", "peak_memory_bytes", *ROLLOUT_COLUMNS} - {"rollout_tokens"}
    return [{k: v for k, v in row.items() if k not in timing} for row in read_metrics(out_dir)]


@pytest.fixture(scope="module")
def lora_grpo(prompts) -> Path:
    out = prompts["root"] / "lora"
    proc = grpo(prompts, out, "--save_interval", "1", "--keep_last", "10")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Rollout: 2 prompt(s) x 4 completions") == 3 and "step 3/3" in proc.stdout
    (out / "stdout.txt").write_text(proc.stdout)
    return out


def test_grpo_logs_the_rewards_and_saves_the_merged_model(lora_grpo):
    rows = read_metrics(lora_grpo)
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for name in ("reward", "reward_std", "rewards/exact_match", "rewards/format", "rewards/short",
                 "completion_length", "clip_ratio"):
        assert all(row[name] for row in rows) and rows[2][f"val_{name}"], name
    assert "kl" not in rows[0]  # beta 0: no reference
    for row in rows:  # the logged reward is the weighted sum of the logged rewards
        total = float(row["rewards/exact_match"]) + 0.5 * float(row["rewards/format"]) + float(row["rewards/short"])
        assert float(row["reward"]) == pytest.approx(total, abs=2e-4)
        assert 1 <= float(row["completion_length"]) <= 6
    assert any(float(row["reward_std"]) > 0 for row in rows)  # the completions differ: advantages, a gradient
    assert (lora_grpo / "final" / "lora.safetensors").is_file()
    summary = json.loads((lora_grpo / "summary.json").read_text())
    assert summary["method"] == "grpo (lora)" and summary["steps"] == 3


def test_grpo_logs_the_tokens_per_sec_of_rollouts_and_of_training_apart(lora_grpo, prompts):
    """Each step's rollout and training time, each with its tokens/s, in metrics.csv, the step line and the summary:
    the two phases fit in the step, and their tokens are the rollouts' prompts and completions."""
    from lit_model.io.prompts import PromptStyle
    from lit_model.io.tokenizer import Tokenizer

    rows = read_metrics(lora_grpo)
    tokenizer, style = Tokenizer(prompts["base"]), PromptStyle.from_name("alpaca")  # a base model's prompts: alpaca's
    prompt_tokens = [len(tokenizer.encode(style.apply(f"Add {a} and {b}."), bos=None)) for a in range(6) for b in range(5)]
    stdout = (lora_grpo / "stdout.txt").read_text()
    for row in rows:
        values = {name: float(row[name]) for name in ROLLOUT_COLUMNS}
        assert all(value > 0 for value in values.values()), row
        assert values["rollout_seconds"] + values["train_seconds"] <= values["step_seconds"], row
        for phase in ("rollout", "train"):
            assert values[f"{phase}_tokens_per_sec"] == pytest.approx(
                values["rollout_tokens"] / values[f"{phase}_seconds"], rel=0.01, abs=1)
        # 2 prompts x 4 completions: 8 prompt rows and the completions
        completions = 8 * float(row["completion_length"])
        assert min(prompt_tokens) * 8 + completions <= values["rollout_tokens"] <= max(prompt_tokens) * 8 + completions
        assert (f"step {row['step']}/3 | " in stdout
                and f"| rollout {int(values['rollout_tokens'])} tok in {values['rollout_seconds']:.2f} s, " in stdout)
    summary = json.loads((lora_grpo / "summary.json").read_text())
    assert summary["rollout_tokens"] == sum(int(row["rollout_tokens"]) for row in rows)
    assert 0 < summary["rollout_seconds"] + summary["train_seconds"] <= summary["wall_time_s"]
    assert summary["rollout_tokens_per_sec"] > 0 and summary["train_tokens_per_sec"] > 0
    assert f"rollouts {summary['rollout_tokens_per_sec']:,.0f} tok/s" in stdout


def test_grpo_is_reproducible_and_resumes_exactly(prompts, lora_grpo, tmp_path):
    """`lit-model finetune grpo` with the same flags and seed: the same rollouts, the same metrics."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LIT_MODEL_CACHE": str(prompts["cache"]), "OMP_NUM_THREADS": "1"}
    again = subprocess.run([sys.executable, "-m", "lit_model", "finetune", "grpo",
                            *map(str, grpo_args(prompts, tmp_path / "again"))],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr
    assert without_timing(tmp_path / "again") == without_timing(lora_grpo)

    interrupted = tmp_path / "interrupted"
    shutil.copytree(lora_grpo, interrupted)
    for path in ("checkpoints/step-00000002", "checkpoints/step-00000003", "final"):  # died after step 1's save
        shutil.rmtree(interrupted / path)
    (interrupted / "summary.json").unlink()
    proc = grpo(prompts, interrupted, "--save_interval", "1", "--keep_last", "10", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "at step 1" in proc.stdout and proc.stdout.count("Rollout:") == 2
    assert without_timing(interrupted) == without_timing(lora_grpo)


def test_adapter_grpo_with_a_reference_trains_and_saves_the_adapter(prompts, tmp_path):
    """--method adapter with --beta > 0: the reference is the base with the prefixes off (its KL logged, 0 at the
    start: the gates are 0), and final/ is finetune/adapter.py's, the base weights untouched beside the adapter."""
    from safetensors.torch import load_file

    out = tmp_path / "adapter"
    proc = grpo(prompts, out, "--method", "adapter", "--adapter_start_layer", "1", "--beta", "0.04",
                "--max_steps", "2", "--eval_interval", "2")
    assert proc.returncode == 0, proc.stderr
    assert "reference: the model with its adapter prefixes off" in proc.stdout and "step 2/2" in proc.stdout
    rows = read_metrics(out)
    assert len(rows) == 2 and float(rows[0]["kl"]) == pytest.approx(0.0, abs=1e-6) and rows[1]["val_reward"]
    adapter = load_file(str(out / "final" / "adapter.safetensors"))
    assert set(adapter) == {"blocks.1.attn.adapter_prefix", "blocks.1.attn.adapter_gate"}
    assert not (out / "final" / "lora.safetensors").exists()
    assert json.loads((out / "summary.json").read_text())["method"] == "grpo (adapter)"


@pytest.mark.slow
def test_the_mean_reward_rises_with_a_reward_the_model_can_learn(prompts, tmp_path):
    """30 steps of full GRPO with a reward for vowels: the policy learns to write them (0.2 -> 0.7 here)."""
    (tmp_path / "vowels.py").write_text("def vowels(prompts, completions, **fields):\n"
                                        "    return [sum(ch in 'aeiou' for ch in c) / max(len(c), 1) for c in completions]\n")
    proc = run("finetune/grpo.py", "--checkpoint_dir", prompts["base"], "--data_path", prompts["data"],
               "--out_dir", tmp_path / "out", "--method", "full", "--max_steps", "30", "--log_interval", "1",
               "--eval_interval", "30", "--eval_iters", "1", "--warmup_steps", "1", "--learning_rate", "0.02",
               "--max_new_tokens", "4", "--num_generations", "8", "--micro_batch_size", "8", "--global_batch_size", "16",
               "--reward", f"{tmp_path / 'vowels.py'}:vowels", "--rehearse", "false", cache=prompts["cache"])
    assert proc.returncode == 0, proc.stderr
    rewards = [float(row["reward"]) for row in read_metrics(tmp_path / "out")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, rewards


def test_a_reward_that_raises_stops_the_run_with_its_name(prompts, tmp_path):
    proc = run("finetune/grpo.py", *grpo_args(prompts, tmp_path / "out")[:-8], "--reward", f"{prompts['rewards']}:raises",
               cache=prompts["cache"])
    assert proc.returncode == 1, proc.stderr
    message = " ".join(proc.stderr.split())
    assert "The reward 'raises' raised KeyError" in message and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "final").exists()


def test_rollouts_leave_no_kv_cache_for_the_training_forward(prompts):
    from lit_model.data.prompts import load_prompt_data
    from lit_model.infer.load import Precision
    from lit_model.infer.rollout import Rollouts
    from lit_model.io.prompts import PromptStyle
    from lit_model.io.tokenizer import Tokenizer
    from lit_model.methods.load import load_gpt
    from lit_model.methods.lora import LoRAConfig, apply_lora
    from lit_model.methods.rewards import load_rewards

    model = load_gpt(prompts["base"])
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0))
    model.train()
    tokenizer = Tokenizer(prompts["base"])
    data = load_prompt_data(prompts["data"], tokenizer, PromptStyle.from_name("alpaca"), 200)
    spec = GRPOSpec(rewards=("length",), num_generations=3, max_new_tokens=5)
    rewards, weights = load_rewards(spec.rewards, None)
    rollouts = Rollouts(model, tokenizer, Precision("32-true", torch.float32, None), spec, rewards, weights, 256,
                        torch.device("cpu"))
    seen = []
    hooks = [block.attn.register_forward_pre_hook(lambda m, args: seen.append(m.kv_cache is not None))
             for block in model.blocks]
    batch = rollouts(data.train[:2], [1, 2])
    assert seen and all(seen)  # the rollout decodes through its cache ...
    assert model.training and all(block.attn.kv_cache is None for block in model.blocks)  # ... and removes it
    assert batch[0].shape[0] == 6 and ((batch[1] != IGNORE_INDEX).sum(dim=1) == batch[4][:, -1]).all()
    # rows right-padded to the longest input rounded up to 8 tokens (not to the context of 256)
    longest = max(len(data.train[row // 3].ids) + int(batch[4][row, -1]) - 1 for row in range(6))
    assert batch[0].shape[1] == -(-longest // 8) * 8 < 256
    seen.clear()
    sums = GRPO(spec).loss_sum(model, batch)
    sums.loss.backward()
    assert seen and not any(seen)  # the training forward runs with no cache attached
    for hook in hooks:
        hook.remove()
    assert torch.equal(rollouts(data.train[:2], [1, 2])[0], batch[0])  # the same seeds, the same completions


def test_a_rollout_decodes_as_many_groups_at_a_time_as_a_micro_batch_holds(prompts):
    """Two prompts' groups of 3 with a micro batch of 6 decode as one batch of 6 (a micro batch of 4 holds one group:
    3 at a time), and draw the same completions either way: each is seeded by itself."""
    from lit_model.data.prompts import load_prompt_data
    from lit_model.infer.load import Precision
    from lit_model.infer.rollout import Rollouts
    from lit_model.io.prompts import PromptStyle
    from lit_model.io.tokenizer import Tokenizer
    from lit_model.methods.load import load_gpt
    from lit_model.methods.rewards import load_rewards

    model, tokenizer = load_gpt(prompts["base"]), Tokenizer(prompts["base"])
    data = load_prompt_data(prompts["data"], tokenizer, PromptStyle.from_name("alpaca"), 200)
    spec = GRPOSpec(rewards=("length",), num_generations=3, max_new_tokens=5)
    assert [spec.rollout_rows(m) for m in (1, 3, 4, 6, 8)] == [3, 3, 3, 6, 6]
    rewards, weights = load_rewards(spec.rewards, None)
    batches, widths = {}, []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[0]))
    for micro in (4, 6):
        widths.clear()
        rollouts = Rollouts(model, tokenizer, Precision("32-true", torch.float32, None), spec, rewards, weights, 256,
                            torch.device("cpu"), rows=spec.rollout_rows(micro))
        batches[micro] = rollouts(data.train[:2], [1, 2])
        assert max(widths) == spec.rollout_rows(micro)
    hook.remove()
    assert torch.equal(batches[4][0], batches[6][0])


def test_a_rollout_that_runs_out_of_memory_recomputes_to_the_same_completions(prompts, monkeypatch):
    """An out-of-memory error inside a rollout's decoding step preempts the newest sequences (the engine's
    recovery): the completions are those of a rollout that never ran out."""
    from lit_model.data.prompts import load_prompt_data
    from lit_model.infer.batching import Engine
    from lit_model.infer.load import Precision
    from lit_model.infer.rollout import Rollouts
    from lit_model.io.prompts import PromptStyle
    from lit_model.io.tokenizer import Tokenizer
    from lit_model.methods.load import load_gpt
    from lit_model.methods.rewards import load_rewards

    model = load_gpt(prompts["base"])
    tokenizer = Tokenizer(prompts["base"])
    data = load_prompt_data(prompts["data"], tokenizer, PromptStyle.from_name("alpaca"), 200)
    spec = GRPOSpec(rewards=("length",), num_generations=3, max_new_tokens=6)  # sampled at temperature 1
    rewards, weights = load_rewards(spec.rewards, None)
    rollouts = Rollouts(model, tokenizer, Precision("32-true", torch.float32, None), spec, rewards, weights, 256,
                        torch.device("cpu"))
    expected = rollouts.generate(data.train[:2], [1, 2])
    forward, failures, raised = Engine._forward, iter([True, False, True] + [False] * 1000), []

    def flaky(self, batch, new_tokens):
        if len(batch) > 1 and next(failures):
            raised.append(len(batch))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return forward(self, batch, new_tokens)

    monkeypatch.setattr(Engine, "_forward", flaky)
    assert rollouts.generate(data.train[:2], [1, 2]) == expected and len(raised) == 2
    assert all(block.attn.kv_cache is None for block in model.blocks)


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_plan_of_a_grpo_run_counts_the_rollout(prompts, method):
    from lit_model.data.prompts import load_prompt_data
    from lit_model.io.prompts import PromptStyle
    from lit_model.io.tokenizer import Tokenizer

    proc = run("finetune/grpo.py", "--checkpoint_dir", prompts["base"], "--data_path", prompts["data"], "--plan", "json",
               "--max_new_tokens", "16", "--method", method, "--prompt_style", "alpaca", cache=prompts["cache"])
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["peak_bytes"] > 0 and plan["run"]["trainable"] == method
    # planned at the data's longest prompt + 16 new tokens, padded to 8 as rollout rows are: not the whole context
    data = load_prompt_data(prompts["data"], Tokenizer(prompts["base"]), PromptStyle.from_name("alpaca"),
                            MODEL["block_size"] - 16)
    seq_len = -(-(data.longest + 16) // 8) * 8
    assert plan["run"]["seq_length"] == seq_len < MODEL["block_size"]
    assert "the longest prompt of the data with --max_new_tokens 16" in plan["run"]["seq_length_source"]
    head_size = MODEL["n_embd"] // MODEL["n_head"]
    # 4 completions x that many positions in whole blocks of 16, keys and values
    kv_cache = 4 * -(-seq_len // 16) * 16 * MODEL["n_layer"] * 2 * MODEL["n_query_groups"] * head_size * 4
    assert plan["phase_categories"]["rollout"]["kv_cache"] == kv_cache
    # the run's phases: training on the rollouts (the step, with no cache: the rollout removed it), the rollout between
    # steps (the training weights and optimizer state, no gradients), the evaluation, the save and the sample
    phases = plan["phase_categories"]
    assert {"train_step", "rollout", "evaluation", "checkpoint_save", "sample"} <= set(phases)
    step, rollout = phases["train_step"], phases["rollout"]
    assert step["kv_cache"] == 0 and step["activations"] + step["logits_loss"] > 0
    assert rollout["parameters"] == step["parameters"] and rollout["optimizer_state"] == step["optimizer_state"] > 0
    assert rollout["gradients"] == 0 and rollout["activations"] > 0
    assert plan["by_phase"]["rollout"] == sum(rollout.values())


def test_lit_model_finetune_grpo_is_the_script():
    from lit_model.entry import SCRIPTS
    from lit_model.recipes import finetune_grpo

    assert SCRIPTS["finetune grpo"] == ("finetune/grpo.py", finetune_grpo.cli)


@pytest.mark.parametrize("extra, needle", [
    (("--num_generations", "1"), "needs at least 2"),
    (("--global_batch_size", "6", "--micro_batch_size", "2"), "make it a multiple of --num_generations 4"),
    (("--method", "full", "--beta", "0.1"), "Use --method lora or adapter (the reference is the base"),
    (("--checkpoint_dir", "ADAPTER", "--method", "adapter", "--beta", "0.1"), "carries a trained LLaMA-Adapter, so "
     "the base with its prefixes off is another model. Use --beta 0"),
    (("--method", "full", "--quantize", "bnb.nf4"), "Use --method lora (QLoRA) or --method adapter with --quantize"),
    (("--temperature", "0"), "use a positive temperature"),
    (("--packing", "true"), "--packing does not apply to GRPO"),
    (("--max_tokens", "1000"), "Give the run's length in steps with --max_steps"),
    (("--loss_type", "bnpo"), "loss_type"),
    (("--reward", "missing.py:f"), "the file missing.py does not exist"),
    (("--reward", "REWARDS:nothing"), "defines no function 'nothing'"),
    (("--reward", "exact_match", "--reward", "length", "--reward_weights", "[1.0]"), "gives 1 weight(s) for 2 reward(s)"),
    (("--reward", "format:(("), "the regular expression is not valid"),
    (("--reward", "close_enough"), "is not a reward"),
])
def test_bad_flags_are_one_paragraph(prompts, tmp_path, capsys, extra, needle):
    from lit_model.recipes.finetune_grpo import cli

    from lit_model.methods.adapter import AdapterConfig

    adapter = tmp_path / "adapter"  # a LLaMA-Adapter fine-tune's checkpoint: its config is what marks it
    shutil.copytree(prompts["base"], adapter)
    AdapterConfig(prompt_length=2, start_layer=1).save(adapter)
    replace = {"REWARDS": str(prompts["rewards"]), "ADAPTER": str(adapter)}
    argv = ["--checkpoint_dir", prompts["base"], "--data_path", prompts["data"], "--out_dir", tmp_path / "out",
            *[replace.get(a, a.replace("REWARDS", replace["REWARDS"])) for a in extra]]
    with pytest.raises(SystemExit) as exit_info:
        cli([str(a) for a in argv])
    message = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and needle in message, message
    assert "Traceback" not in message and not (tmp_path / "out").exists()


def test_the_config_hub_yamls_parse_and_the_default_one_spells_out_the_defaults():
    from lit_model.recipes.cli import parse
    from lit_model.recipes.finetune_grpo import GRPOArgs

    paths = sorted((ROOT / "config_hub" / "finetune").glob("*/grpo.yaml"))
    assert len(paths) >= 2 and all(parse(GRPOArgs, ["--config", str(path)]).num_generations >= 2 for path in paths)
    path = ROOT / "config_hub" / "finetune" / "lit-model-5m" / "grpo.yaml"
    assert parse(GRPOArgs, ["--config", str(path)]) == parse(GRPOArgs, [])
