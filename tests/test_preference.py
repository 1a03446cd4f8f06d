"""Preference objectives (lit_model/methods/preference.py) against TRL's own code on the same tiny model and batch:
the completions' log-probabilities against TRL's ``get_batch_logps``, DPO / IPO (and their logged rewards) through
``DPOTrainer._compute_loss`` itself, SimPO through ``CPOTrainer.cpo_loss``, ORPO through ``ORPOTrainer``'s
odds-ratio loss plus its NLL term."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lit_model import GPT, Config
from lit_model.core.errors import UserError
from lit_model.data.instruct import IGNORE_INDEX
from lit_model.data.instruct import padded_length
from lit_model.data.preference import collate_pairs, load_preference_data, pack_rows
from lit_model.io.prompts import PromptStyle
from lit_model.io.tokenizer import Tokenizer
from lit_model.methods.adapter import AdapterConfig, apply_adapter
from lit_model.methods.lora import LoRAConfig, adapters_disabled, apply_lora
from lit_model.methods.preference import Preference, pair_rows, sequence_log_probs

trl = pytest.importorskip("trl")
from trl import DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

VOCAB, PAIRS, LENGTH, PROMPT = 96, 3, 12, 4


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(name="t", block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_embd=32,
                       n_head=4, n_query_groups=2, intermediate_size=64))
    model.init_weights()
    return model


def pair_batch(equal_lengths: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, 2, LENGTH + 1) token rows (prompt, completion, padding) and the completion mask of the same shape;
    the chosen and rejected completions of a pair share the prompt and differ in length unless ``equal_lengths``."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (PAIRS, 2, LENGTH + 1), generator=generator)
    ids[:, 1, :PROMPT] = ids[:, 0, :PROMPT]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for pair in range(PAIRS):
        for side in range(2):
            end = LENGTH + 1 if equal_lengths else LENGTH + 1 - (pair + 2 * side) % 4
            mask[pair, side, PROMPT:end] = True
    return ids, mask, mask.sum(-1)


def lit_batch(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lit-model's batch: inputs and shifted targets, IGNORE_INDEX outside the completion."""
    return ids[..., :-1], ids[..., 1:].masked_fill(~mask[..., 1:], IGNORE_INDEX)


def full_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for every row of ``ids`` (rows, LENGTH + 1), as TRL's trainers see a model's output."""
    return model(ids.flatten(0, 1)).float()


def policy_log_probs(model: GPT, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    inputs, targets = lit_batch(ids, mask)
    with torch.no_grad():
        return model(inputs.flatten(0, 1), readout=lambda m, h: sequence_log_probs(m, h, targets.flatten(0, 1), 5))[0]


def test_log_probs_equal_trls_get_batch_logps():
    model, (ids, mask, _) = tiny_model(), pair_batch()
    labels = ids.flatten(0, 1).masked_fill(~mask.flatten(0, 1), -100)
    with torch.no_grad():
        logits = full_logits(model, ids)
    for average in (False, True):
        expected = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)
        inputs, targets = lit_batch(ids, mask)
        with torch.no_grad():
            summed, counts = model(inputs.flatten(0, 1), readout=lambda m, h: sequence_log_probs(
                m, h, targets.flatten(0, 1), chunk_size=7))
        got = summed / counts if average else summed
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def trl_dpo(loss_type: str, beta: float, log_probs: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor,
            mask: torch.Tensor) -> tuple[float, dict[str, float]]:
    """``DPOTrainer._compute_loss`` as TRL runs it, on a model output that carries ``log_probs`` (the per-token
    log-probabilities, which are what its fused head returns) and precomputed reference log-probabilities."""
    rows = ids.flatten(0, 1)  # TRL's order: every chosen row, then every rejected row
    order = torch.cat([torch.arange(0, rows.size(0), 2), torch.arange(1, rows.size(0), 2)])
    completion = mask.flatten(0, 1)[order].long()
    per_token = torch.zeros(rows.size(0), rows.size(1) - 1)
    per_token[:, 0] = log_probs[order]  # only the rows' sums matter to the loss and the rewards
    output = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                             mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token, dtype=torch.bool))
    identity = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=identity, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": rows[order], "attention_mask": torch.ones_like(rows), "completion_mask": completion,
              "ref_chosen_logps": ref.view(-1, 2)[:, 0], "ref_rejected_logps": ref.view(-1, 2)[:, 1]}
    loss = DPOTrainer._compute_loss(trainer, lambda **kwargs: output, inputs, return_outputs=False)
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_dpo_and_ipo_equal_trls_loss_and_rewards(loss):
    beta = 0.2
    reference, policy = tiny_model(0), tiny_model(1)
    ids, mask, _ = pair_batch()
    ref = policy_log_probs(reference, ids, mask)
    objective = Preference(loss=loss, beta=beta, chunk_size=5)
    inputs, targets = lit_batch(ids, mask)
    total, count, logged = objective.loss_sum(policy, (inputs, targets, ref.view(PAIRS, 2)))
    expected, metrics = trl_dpo({"dpo": "sigmoid", "ipo": "ipo"}[loss], beta, policy_log_probs(policy, ids, mask),
                                ref, ids, mask)
    assert count.item() == PAIRS
    assert total.item() / PAIRS == pytest.approx(expected, abs=1e-5)
    assert set(logged) == set(objective.metric_names)
    for name, value in logged.items():
        assert value.item() / PAIRS == pytest.approx(metrics[name], abs=1e-5), name


def test_simpo_equals_trls_cpo_loss():
    beta, gamma = 2.0, 0.5
    model, (ids, mask, lengths) = tiny_model(), pair_batch()
    average = (policy_log_probs(model, ids, mask) / lengths.flatten()).view(-1, 2)
    cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                          accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen, rejected = CPOTrainer.cpo_loss(cpo, average[:, 0], average[:, 1])
    total, _, logged = Preference(loss="simpo", beta=beta, simpo_gamma=gamma).loss_sum(model, lit_batch(ids, mask))
    assert total.item() / PAIRS == pytest.approx(losses.mean().item(), abs=1e-5)
    assert logged["rewards/chosen"].item() / PAIRS == pytest.approx(chosen.mean().item(), abs=1e-5)
    assert logged["rewards/rejected"].item() / PAIRS == pytest.approx(rejected.mean().item(), abs=1e-5)


def test_orpo_equals_trls_odds_ratio_loss_and_nll():
    """ORPO's NLL term is the chosen completion's mean token NLL per pair (the paper's eq. 6, averaged over pairs);
    TRL averages it over the batch's chosen tokens instead: the two agree where the chosen completions are equally
    long, as here."""
    beta = 0.1
    model, (ids, mask, lengths) = tiny_model(), pair_batch(equal_lengths=True)
    average = (policy_log_probs(model, ids, mask) / lengths.flatten()).view(-1, 2)
    orpo = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    ratio_losses = ORPOTrainer.odds_ratio_loss(orpo, average[:, 0], average[:, 1])[0]
    inputs, targets = lit_batch(ids, mask)
    with torch.no_grad():
        logits = model(inputs[:, 0])
    nll = F.cross_entropy(logits.flatten(0, 1), targets[:, 0].flatten(), ignore_index=IGNORE_INDEX)
    total = Preference(loss="orpo", beta=beta).loss_sum(model, (inputs, targets)).loss
    assert total.item() / PAIRS == pytest.approx((nll - ratio_losses.mean()).item(), abs=1e-5)


def test_lora_reference_is_the_base_and_dpo_starts_at_ln2():
    """With LoRA the reference is the model with its adapters off: the base model's log-probabilities; at the start
    (B = 0) the policy equals it, so DPO's loss is ln 2 and its gradient reaches the adapters."""
    base, ids_mask = tiny_model(), pair_batch()
    ids, mask, _ = ids_mask
    model = tiny_model()
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(0, 0.5)  # adapters that change the output
    with adapters_disabled(model):
        torch.testing.assert_close(policy_log_probs(model, ids, mask), policy_log_probs(base, ids, mask))
    assert not torch.allclose(policy_log_probs(model, ids, mask), policy_log_probs(base, ids, mask))

    fresh = tiny_model()
    apply_lora(fresh, LoRAConfig(r=4, alpha=8, dropout=0.0))
    total, count, _ = Preference(loss="dpo", reference=adapters_disabled, chunk_size=5).loss_sum(fresh, lit_batch(ids, mask))
    assert total.item() / count.item() == pytest.approx(math.log(2), abs=1e-6)
    total.backward()
    assert all(p.grad is not None for n, p in fresh.named_parameters() if n.endswith("lora_A"))


def test_adapter_reference_is_exactly_the_base_and_dpo_starts_at_ln2():
    """With LLaMA-Adapter the reference is the model with its prefixes off: exactly the base model's
    log-probabilities (the same operations, bit for bit); at the start (gates 0) the policy equals it, so DPO's loss
    is ln 2 and its gradient reaches the gates."""
    base, (ids, mask, _) = tiny_model(), pair_batch()
    model = tiny_model()
    apply_adapter(model, AdapterConfig(prompt_length=3, start_layer=0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("adapter_gate"):
                parameter.normal_(0, 0.5)  # open gates: prefixes that change the output
    with adapters_disabled(model):
        assert torch.equal(policy_log_probs(model, ids, mask), policy_log_probs(base, ids, mask))
    assert all(block.attn.adapter_enabled for block in model.blocks)  # back on after the block
    assert not torch.allclose(policy_log_probs(model, ids, mask), policy_log_probs(base, ids, mask))

    fresh = tiny_model()
    apply_adapter(fresh, AdapterConfig(prompt_length=3, start_layer=1))
    total, count, _ = Preference(loss="dpo", reference=adapters_disabled, chunk_size=5).loss_sum(fresh, lit_batch(ids, mask))
    assert total.item() / count.item() == pytest.approx(math.log(2), abs=1e-6)
    total.backward()
    assert fresh.blocks[1].attn.adapter_gate.grad.abs().sum() > 0


def test_the_loss_of_a_batch_is_the_sum_of_its_pairs():
    """The step splits a batch by pairs: the objective's sums over any split add up to the whole batch's."""
    model, (ids, mask, _) = tiny_model(), pair_batch()
    ref = policy_log_probs(tiny_model(1), ids, mask).view(PAIRS, 2)
    inputs, targets = lit_batch(ids, mask)
    objective = Preference(loss="dpo", chunk_size=5)
    whole = objective.loss_sum(model, (inputs, targets, ref)).loss
    parts = [objective.loss_sum(model, (inputs[i : i + 1], targets[i : i + 1], ref[i : i + 1]))[0] for i in range(PAIRS)]
    assert whole.item() == pytest.approx(sum(p.item() for p in parts), abs=1e-5)


def test_a_trained_head_keeps_no_gradient_of_its_weight_per_row_and_gives_the_fused_losss_gradients():
    """Full DPO: the fused loss would keep each row's gradient of the head's weight until backward (rows x vocabulary x
    embedding); recomputing each row's logits in backward keeps none, with the same gradients."""
    from lit_model.methods import preference

    (ids, mask, _), objective = pair_batch(), Preference(loss="dpo", chunk_size=5)
    inputs, targets = lit_batch(ids, mask)
    ref = policy_log_probs(tiny_model(1), ids, mask).view(PAIRS, 2)
    results = []
    for recompute in (True, False):
        model = tiny_model()
        head = model.lm_head.weight
        saved = []
        original = preference.CausalLM
        if not recompute:  # the fused loss per row, as before
            preference.CausalLM = lambda chunk_size, recompute_head: original(chunk_size)
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                loss = objective.loss_sum(model, (inputs, targets, ref)).loss
        finally:
            preference.CausalLM = original
        loss.backward()
        head_sized = [t for t in saved if t.shape == head.shape and t.data_ptr() != head.data_ptr()]
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], len(head_sized)))
    (loss, grads, kept), (fused_loss, fused_grads, fused_kept) = results
    assert (kept, fused_kept) == (0, 2 * PAIRS)
    torch.testing.assert_close(loss, fused_loss, rtol=1e-5, atol=1e-6)
    for grad, fused in zip(grads, fused_grads):
        torch.testing.assert_close(grad, fused, rtol=1e-4, atol=1e-6)


# ---- --packing: a micro batch's rows packed into rows of up to the run's length ----------------------------------
@pytest.mark.parametrize("loss, reference", [("dpo", "precomputed"), ("dpo", "adapters"), ("simpo", "none")])
def test_packed_rows_give_the_unpacked_loss_rewards_and_gradients(loss, reference):
    """--packing packs the six rows of three pairs into two rows of 32 tokens, each row attending only to itself with
    its positions from 0: the loss, every logged reward and every gradient are the unpacked ones (to float rounding),
    for a precomputed reference, LoRA's (its adapters off, through the same packed rows) and a reference-free loss."""
    ids, mask, _ = pair_batch()
    inputs, targets = lit_batch(ids, mask)
    batch = (inputs, targets, policy_log_probs(tiny_model(2), ids, mask).view(PAIRS, 2)) if reference == "precomputed" \
        else (inputs, targets)
    assert pair_rows(batch, 32).input_ids.shape == (2, 32)  # 2 x 32 tokens computed, not 6 x 12

    def step(pack_length):
        model = tiny_model(1)
        if reference == "adapters":
            apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0))
            torch.manual_seed(3)
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if name.endswith("lora_B"):
                        parameter.normal_(0, 0.5)  # a policy away from its reference
        objective = Preference(loss=loss, beta=0.5, chunk_size=5, pack_length=pack_length,
                               reference=adapters_disabled if reference == "adapters" else None)
        sums = objective.loss_sum(model, batch)
        sums.loss.backward()
        return sums, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    (unpacked, unpacked_grads), (packed, packed_grads) = step(None), step(32)
    assert packed.count.item() == unpacked.count.item() == PAIRS
    assert packed.loss.item() == pytest.approx(unpacked.loss.item(), abs=1e-5)
    assert unpacked.metrics["rewards/margins"].abs().item() > 0.01  # rewards that say something
    for name, value in unpacked.metrics.items():
        assert packed.metrics[name].item() == pytest.approx(value.item(), abs=1e-5), name
    assert packed_grads.keys() == unpacked_grads.keys() and unpacked_grads
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-5, msg=name)


def test_pack_rows_places_every_row_once_within_the_length_and_never_in_more_tokens():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        count, length = int(torch.randint(1, 17, (1,), generator=generator)), 256
        lengths = torch.randint(1, length + 1, (count,), generator=generator).tolist()
        rows, width = pack_rows(lengths, length)
        assert sorted(i for row in rows for i in row) == list(range(count))
        assert max(sum(lengths[i] for i in row) for row in rows) <= width <= length
        assert len(rows) * width <= count * padded_length(max(lengths), max_length=length)  # the unpacked layout's
    rows, width = pack_rows([100, 90, 95, 80], 256)  # two pairs of rows of up to 100 tokens: two rows of 192
    assert (len(rows), width) == (2, 192)


# ---- data: records -> pairs of token rows --------------------------------------------------------------------
def write_jsonl(path, records) -> None:
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")


def test_string_and_conversational_records_give_pairs_whose_targets_are_the_completions(tiny_setup, tmp_path):
    tokenizer = Tokenizer(tiny_setup["tokenizer"])
    style = PromptStyle.from_name("chatml")
    records = [
        {"prompt": "Name a sorting algorithm.", "chosen": "Merge sort.", "rejected": "A spoon."},
        {"prompt": [{"role": "user", "content": "Say hi."}], "chosen": [{"role": "assistant", "content": "Hi!"}],
         "rejected": [{"role": "assistant", "content": "No."}]},
        # an implicit prompt: the messages both conversations share
        {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
         "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]},
    ]
    write_jsonl(tmp_path / "pairs.jsonl", records * 4)
    data = load_preference_data(tmp_path / "pairs.jsonl", tokenizer, style, seq_length=256, val_fraction=0.25)
    assert len(data.train) + len(data.val) == 12 and "12 records" in data.description
    expected = {("Merge sort.", "A spoon."), ("Hi!", "No."), ("4", "5")}
    seen = set()
    for index in range(len(data.train)):
        input_ids, targets = data.train[index]
        assert input_ids.shape == targets.shape == (2, data.train.lengths[index])
        completions = tuple(tokenizer.decode(row[row != IGNORE_INDEX]) for row in targets)
        seen.add(tuple(text.replace(style.end, "").strip() for text in completions))
        # the two rows share the prompt: the tokens before the first target agree
        first = [int((row != IGNORE_INDEX).nonzero()[0]) for row in targets]
        assert first[0] == first[1] and torch.equal(input_ids[0, : first[0]], input_ids[1, : first[1]])
    assert seen == expected
    batch = collate_pairs([data.train[i] for i in range(3)])
    assert batch[0].shape[:2] == (3, 2) and batch[0].shape[2] % 64 == 0 and batch[1].shape == batch[0].shape


@pytest.mark.parametrize("record, named", [
    ({"prompt": "p", "chosen": "c"}, "'rejected'"),
    ({"prompt": "p", "chosen": "c", "rejected": ""}, "'rejected'"),
    ({"prompt": "p", "chosen": ["c"], "rejected": "r"}, "both strings or both lists"),
    ({"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "user", "content": "c"}],
      "rejected": [{"role": "assistant", "content": "r"}]}, "assistant messages"),
])
def test_a_bad_record_is_named_with_the_fix(tiny_setup, tmp_path, record, named):
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    write_jsonl(tmp_path / "pairs.jsonl", [good, good, record, good])
    with pytest.raises(UserError, match=named) as raised:
        load_preference_data(tmp_path / "pairs.jsonl", Tokenizer(tiny_setup["tokenizer"]), PromptStyle.from_name("alpaca"),
                             seq_length=64)
    assert "line 3 of" in str(raised.value) and "pairs.jsonl" in str(raised.value)  # the record, by file and line


def test_preference_batches_feed_the_objective(tiny_setup, tmp_path):
    """The collated batch is what Preference.loss_sum takes: a SimPO loss on the data, finite, with gradients."""
    tokenizer = Tokenizer(tiny_setup["tokenizer"])
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"Q{i}?", "chosen": "Yes, " * (i + 1), "rejected": "No."}
                                           for i in range(6)])
    data = load_preference_data(tmp_path / "pairs.jsonl", tokenizer, PromptStyle.from_name("alpaca"), seq_length=256,
                                val_fraction=0.2)
    torch.manual_seed(0)
    model = GPT(Config(name="t", block_size=256, vocab_size=512, padded_vocab_size=512, n_layer=1, n_embd=32,
                       n_head=2, n_query_groups=1, intermediate_size=64))
    total, count, _ = Preference(loss="simpo").loss_sum(model, collate_pairs([data.train[i] for i in range(len(data.train))]))
    assert count.item() == len(data.train) and torch.isfinite(total)
    total.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


# ---- the planner traces the step the objective runs ----------------------------------------------------------
def test_the_planner_traces_the_preference_step():
    """A preference run's plan is the trace of its own step: pairs of rows through the policy, and with LoRA the
    reference's forward with the adapters off, which runs before the policy's and so adds nothing to the step's peak
    (the peak of a reference precomputed in the batches); two rows a pair hold no more than two rows of supervised
    fine-tuning (each row's log-probabilities come from the same fused chunked head, a row at a time). With
    --packing the trace packs the example rows (each whole: one a packed row) and adds their document masks, no
    more than packed supervised fine-tuning's."""
    from test_memory_plan import args, resolved, tiny

    from lit_model.methods.preference import PreferenceSpec
    from lit_model.plan.trace import trace_training

    def peak(micro: int, spec=None, packing: bool = False) -> int:
        run = resolved(tiny(n_layer=2), args(micro_batch_size=micro, global_batch_size=micro), "lora",
                       device_type="cpu")
        traced = trace_training(run.replace(preference=spec, packing=packing), phases=("train_step",))
        phases = traced.phases["train_step"]
        return sum(phases.values())

    sft, adapters_off, precomputed = peak(4), peak(2, PreferenceSpec("dpo")), peak(2, PreferenceSpec("dpo", reference="precomputed"))
    assert adapters_off == precomputed
    assert 0.5 * sft < precomputed <= sft
    assert precomputed < peak(2, PreferenceSpec("dpo", reference="precomputed"), packing=True) <= peak(4, packing=True)
