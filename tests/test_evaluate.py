"""lit-model evaluate: lm-eval's requests answered by lit-model's inference code score what lm-eval's own ``hf`` model
scores on the same checkpoint converted to transformers (lit_to_hf); an unmerged LoRA scores as its merge; the
command's bad inputs end in one paragraph and write nothing. Tiny random model, local tasks, nothing downloaded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from conftest import random_checkpoint, run_captured  # noqa: E402
from lit_model import Config, UserError  # noqa: E402
from lit_model.entry import main as lit_model_main  # noqa: E402
from lit_model.infer.load import Precision, load_model  # noqa: E402
from lit_model.infer.score import Scorer, rolling_windows  # noqa: E402
from lit_model.io.checkpoint import lit_state_dict, save_checkpoint_dir  # noqa: E402
from lit_model.io.convert import lit_to_hf  # noqa: E402
from lit_model.io.prompts import PromptStyle  # noqa: E402
from lit_model.io.tokenizer import Tokenizer  # noqa: E402
from lit_model.methods.lora import LORA_WEIGHTS, LoRAConfig, apply_lora, merge  # noqa: E402
from lit_model.recipes.evaluate import cli, harness_model  # noqa: E402

BLOCK = 64  # the model's context: long texts and contexts are cut and windowed
TINY = dict(name="tiny-eval", block_size=BLOCK, vocab_size=512, n_layer=2, n_embd=64, n_head=4, n_query_groups=2,
            intermediate_size=128)
FP32 = Precision("32-true", torch.float32, autocast=None)
QUESTIONS = [  # (question, choices, answer): Python the tokenizer was trained on
    ("def f(x):\n    return", [" x", " None", " 1"], 0),
    ("import", [" os", " sys", " re"], 1),
    ("for i in", [" range(10):", " x:"], 0),
    ("class A(object):\n   ", [" pass", " def __init__(self):"], 1),
    ("if __name__ ==", [" '__main__':", " None:"], 0),
]
LONG = "\n".join(f"def function_{i}(argument, other=None):\n    return argument + {i}" for i in range(8))


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing comes from the Hugging Face Hub: the tasks' data are local files."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        for module, name in (("datasets.config", "HF_DATASETS_OFFLINE"),
                             ("huggingface_hub.constants", "HF_HUB_OFFLINE")):
            if module in sys.modules:  # read once at import: a test before this one may have imported it
                patch.setattr(sys.modules[module], name, True)
        yield


@pytest.fixture(scope="module")
def checkpoint(tiny_setup, tmp_path_factory) -> Path:
    """A random Llama-style checkpoint whose weights are large enough that its choices differ."""
    return random_checkpoint(Config(**TINY), tiny_setup["tokenizer"], tmp_path_factory.mktemp("eval") / "ckpt")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict[str, Path]:
    """Local lm-eval tasks over jsonl files: multiple choice, generation until a newline, perplexity."""
    root = tmp_path_factory.mktemp("tasks")
    rows = [{"question": q, "choices": c, "answer": a, "text": q + c[a]} for q, c, a in QUESTIONS]
    rows.append({"question": LONG, "choices": [" x", " y"], "answer": 0, "text": LONG})
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'data.jsonl'}\ntest_split: test\n"
    files = {
        "mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
              "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices[answer]}}'\n"
               "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n",
        "ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
               "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
    }
    paths = {}
    for name, body in files.items():
        paths[name] = root / f"tiny_{name}.yaml"
        paths[name].write_text(f"task: tiny_{name}\n{common}{body}")
    return paths


def ours(checkpoint_dir: Path, batch_size: int = 2):
    """lit-model's lm-eval model over ``checkpoint_dir`` in fp32 on the CPU."""
    model = load_model(checkpoint_dir, ["cpu"], torch.float32, decoding=True)
    style = PromptStyle.from_checkpoint(checkpoint_dir)
    return harness_model(model, Tokenizer(checkpoint_dir), style, FP32, batch_size, 1234, checkpoint_dir)


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    """(lit-model's lm-eval model, lm-eval's hf model on the checkpoint converted to transformers)."""
    hf_dir = lit_to_hf(checkpoint, tmp_path_factory.mktemp("hf") / "hf")
    hf = HFLM(pretrained=str(hf_dir), backend="causal", device="cpu", dtype="float32", batch_size=3, max_length=BLOCK)
    return ours(checkpoint), hf


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


LOGLIKELIHOOD = [  # an empty context (scored after bos), a context longer than the model's (cut from the left)
    *((q, c) for q, choices, _ in QUESTIONS for c in choices), ("", "import os"), (LONG, " x"), ("x = ", LONG[:40]),
]


def test_loglikelihoods_and_scores_equal_lm_evals_hf_model(models, tasks):
    lit, hf = models
    got, expected = lit.loglikelihood(requests("loglikelihood", LOGLIKELIHOOD)), hf.loglikelihood(
        requests("loglikelihood", LOGLIKELIHOOD))
    assert [g for _, g in got] == [g for _, g in expected]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=1e-4)
    assert len({round(lp, 3) for lp, _ in got}) > len(got) // 2  # the model tells the choices apart

    def scores(lm) -> dict:
        result = simple_evaluate(model=lm, tasks=[str(tasks["mc"])], task_manager=TaskManager(include_defaults=False),
                                 bootstrap_iters=0, log_samples=False)
        return {k: v for k, v in result["results"]["tiny_mc"].items() if k.startswith("acc")}

    expected_scores = scores(hf)
    assert {"acc,none", "acc_norm,none"} <= set(expected_scores) and scores(lit) == expected_scores


def test_rolling_loglikelihoods_equal_lm_evals_hf_model(models):
    lit, hf = models
    texts = [("import os",), (LONG[:150],), (LONG,)]  # one window, about two, several (LONG: > 3 x the context)
    assert len(lit.tok_encode(LONG)) > 3 * BLOCK
    got, expected = (lm.loglikelihood_rolling(requests("loglikelihood_rolling", texts)) for lm in (lit, hf))
    assert got == pytest.approx(expected, abs=1e-4, rel=1e-6)


def test_rolling_windows_predict_every_token_once_from_full_windows():
    tokens = list(range(10))
    assert rolling_windows(tokens, -1, 4) == [([-1], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]), ([5, 6, 7], [8, 9])]
    for context, continuation in rolling_windows(list(range(100)), -1, 16):  # every window reads 16 inputs
        assert len([*context, *continuation][-17:-1]) == 16 or context == [-1]


def test_greedy_generations_equal_lm_evals_hf_model(models):
    lit, hf = models
    until = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    prompts = [(q, dict(until)) for q, _, _ in QUESTIONS] + [(LONG, dict(until))]
    got = lit.generate_until(requests("generate_until", prompts))
    assert got == hf.generate_until(requests("generate_until", prompts))
    assert any(got) and all("\n" not in text for text in got)


def test_auto_batch_size_halves_until_a_batch_fits(checkpoint, monkeypatch):
    """--batch_size auto: a batch that runs out of memory is retried at half the rows; the scores stay the same."""
    model = load_model(checkpoint, ["cpu"], torch.float32)
    pairs = [(list(range(1, 3 + i)), [5, 6]) for i in range(20)]
    expected = Scorer(model, FP32, batch_size=1).continuations(pairs)
    auto, sizes = Scorer(model, FP32, batch_size=None), []
    score_batch = auto._score_batch

    def tight(batch):
        sizes.append(len(batch))
        if len(batch) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return score_batch(batch)

    monkeypatch.setattr(auto, "_score_batch", tight)
    got = auto.continuations(pairs)
    assert sizes == [20, 10, 5, 5, 5, 5] and auto.requests == 20
    assert [s.logprob for s in got] == pytest.approx([s.logprob for s in expected], abs=1e-5)
    fixed = Scorer(model, FP32, batch_size=16)  # a batch size given is kept: running out of memory is a message
    monkeypatch.setattr(fixed, "_score_batch", tight)
    with pytest.raises(UserError, match="Out of memory while scoring 16 sequence.* smaller --batch_size"):
        fixed.continuations(pairs)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_renders_and_scores_as_lm_evals_hf_model(checkpoint, tasks, tmp_path):
    """--apply_chat_template: the conversation lm-eval builds (few-shot examples as turns, a prefilled reply left
    open) renders as transformers renders the checkpoint's template, and the task scores the same."""
    from transformers import AutoTokenizer

    chat = tmp_path / "chat"
    model = load_model(checkpoint, ["cpu"], torch.float32)
    save_checkpoint_dir(lit_state_dict(model, model.config), model.config, chat, tokenizer_dir=checkpoint)
    (chat / "chat_template.jinja").write_text(CHATML)
    hf_dir = lit_to_hf(chat, tmp_path / "hf")
    lit, tokenizer = ours(chat), AutoTokenizer.from_pretrained(hf_dir)
    history = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "import"},
               {"role": "assistant", "content": " os"}, {"role": "user", "content": "for i in"}]
    for messages, opened in ((history, True), ([*history, {"role": "assistant", "content": " range"}], False)):
        assert lit.apply_chat_template(messages, add_generation_prompt=opened) == tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=opened, continue_final_message=not opened)

    hf = HFLM(pretrained=str(hf_dir), backend="causal", device="cpu", dtype="float32", batch_size=3, max_length=BLOCK)
    results = [simple_evaluate(model=lm, tasks=[str(tasks["mc"])], task_manager=TaskManager(include_defaults=False),
                               num_fewshot=1, apply_chat_template=True, bootstrap_iters=0, log_samples=False)
               for lm in (lit, hf)]
    assert results[0]["results"]["tiny_mc"] == results[1]["results"]["tiny_mc"]


def test_an_unmerged_lora_scores_what_its_merged_checkpoint_scores(checkpoint, tmp_path):
    from lit_model.recipes.finetune import gather_trainable

    unmerged = tmp_path / "unmerged"
    model = load_model(checkpoint, ["cpu"], torch.float32)
    save_checkpoint_dir(lit_state_dict(model, model.config), model.config, unmerged, tokenizer_dir=checkpoint)
    config = LoRAConfig(r=4, alpha=8, mlp=True, projection=True)
    apply_lora(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.2)
    save_file(gather_trainable(model), str(unmerged / LORA_WEIGHTS))
    config.save(unmerged)
    merged = merge(unmerged, tmp_path / "merged")

    request = requests("loglikelihood", LOGLIKELIHOOD)
    lora_scores = ours(unmerged).loglikelihood(request)
    assert [lp for lp, _ in lora_scores] == pytest.approx([lp for lp, _ in ours(merged).loglikelihood(request)],
                                                          abs=1e-4)
    base_scores = ours(checkpoint).loglikelihood(request)
    assert max(abs(a[0] - b[0]) for a, b in zip(lora_scores, base_scores)) > 0.1  # the adapter is applied


def evaluate(*args) -> object:
    return run_captured(lambda: cli([str(a) for a in args], prog="main.py"), list(args))


def one_paragraph(stderr: str) -> str:
    assert stderr.startswith("error: ") and "Traceback" not in stderr and "\n\n" not in stderr.strip(), stderr
    return " ".join(stderr.split())


def test_the_command_writes_results_and_keeps_them_without_overwrite(checkpoint, tasks, tmp_path):
    out = tmp_path / "out"
    specs = ",".join(str(tasks[name]) for name in ("mc", "gen", "ppl"))
    args = ("--checkpoint_dir", checkpoint, "--tasks", specs, "--out_dir", out, "--batch_size", "auto", "--limit", "4")
    result = evaluate(*args)
    assert result.returncode == 0, result.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {"tiny_mc", "tiny_gen", "tiny_ppl"}
    assert results["config"]["checkpoint_dir"] == str(checkpoint) and results["config"]["limit"] == 4
    assert "|tiny_mc " in result.stdout and (out / "results.md").read_text() in result.stdout
    assert "log-likelihood: " in result.stderr and " tokens/s" in result.stderr

    before = (out / "results.json").read_bytes()
    again = evaluate(*args)
    assert again.returncode == 2 and "--overwrite" in one_paragraph(again.stderr)
    assert (out / "results.json").read_bytes() == before
    assert evaluate(*args, "--overwrite", "--limit", "2").returncode == 0
    assert json.loads((out / "results.json").read_text())["config"]["limit"] == 2


def test_lit_model_evaluate_is_the_command(checkpoint, tasks, tmp_path):
    lit_model_main(["evaluate", "--checkpoint_dir", str(checkpoint), "--tasks", str(tasks["mc"]),
                    "--out_dir", str(tmp_path / "out"), "--limit", "1"])
    assert "tiny_mc" in json.loads((tmp_path / "out" / "results.json").read_text())["results"]


@pytest.mark.parametrize("problem, code, message", [
    ("no tasks", 2, "--tasks names no task"),
    ("unknown task", 2, "Unknown task 'hellaswagg'. Did you mean hellaswag"),
    ("missing task file", 2, "no such task file"),
    ("missing checkpoint", 1, "does not exist"),
    ("negative limit", 2, "--limit 0 must be at least 1"),
    ("lm-eval missing", 1, 'pip install "lit-model[evaluate]"'),
])
def test_bad_input_is_one_paragraph_and_writes_nothing(problem, code, message, checkpoint, tasks, tmp_path,
                                                        monkeypatch):
    out = tmp_path / "out"
    flags = {"--checkpoint_dir": checkpoint, "--tasks": tasks["mc"], "--out_dir": out}
    flags.update({
        "no tasks": {"--tasks": ","},
        "unknown task": {"--tasks": "hellaswagg"},
        "missing task file": {"--tasks": tmp_path / "nope.yaml"},
        "missing checkpoint": {"--checkpoint_dir": tmp_path / "nope"},
        "negative limit": {"--limit": 0},
    }.get(problem, {}))
    if problem == "lm-eval missing":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    result = evaluate(*(part for flag, value in flags.items() for part in (flag, value)))
    assert result.returncode == code and message in one_paragraph(result.stderr), result.stderr
    assert not out.exists() and result.stdout == ""


def test_generations_run_batched_by_the_engine_as_one_at_a_time(checkpoint, monkeypatch):
    """generate_until runs every request through the continuous-batching engine, up to the batch size decoding
    together whatever their prompts' lengths and settings, and greedy decoding gives each what it gives the request
    alone."""
    from lit_model.infer.batching import Engine

    lit = ours(checkpoint, batch_size=3)
    ids = lit.tok_encode(LONG)
    texts = [lit.tokenizer.decode(torch.tensor(ids[i : i + 9 + i // 9])) for i in range(0, 54, 9)]
    settings = [{"until": ["\n"], "max_gen_toks": 6, "do_sample": False}, {"until": ["x"], "max_gen_toks": 5}]
    prompts = [(text, dict(settings[i % 2])) for i, text in enumerate(texts + [q for q, _, _ in QUESTIONS])]
    rows, forward = [], Engine._forward

    def recorded(self, batch, new_tokens):
        if len(new_tokens[0]) == 1:  # a decoding step
            rows.append(len(batch))
        return forward(self, batch, new_tokens)

    monkeypatch.setattr(Engine, "_forward", recorded)
    batched = lit.generate_until(requests("generate_until", prompts))
    assert max(rows) == 3  # decoding steps of up to the batch size
    alone = ours(checkpoint, batch_size=1).generate_until(requests("generate_until", prompts))
    assert batched == alone and sum(map(len, batched)) > 0
    assert all(block.attn.kv_cache is None for block in lit.model.blocks)  # the pool is gone after generating


def test_scores_are_the_same_when_the_head_runs_few_positions_at_a_time(models, monkeypatch):
    """The head runs at most HEAD_BYTES of logits at once (here 5 positions' worth): the scores are the same."""
    lit, _ = models
    texts = [("import os",), (LONG,)]
    expected = lit.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    monkeypatch.setattr("lit_model.infer.score.HEAD_BYTES", 5 * 4 * lit.model.config.padded_vocab_size)
    assert lit.loglikelihood_rolling(requests("loglikelihood_rolling", texts)) == pytest.approx(expected, abs=1e-5)


def test_plan_prints_the_memory_of_scoring_and_generating_without_the_weights(checkpoint, tmp_path):
    """--plan text|json: the scoring pass at the context's length and a generation batch's KV cache, from the
    config alone (a directory without weights or tokenizer), no tasks needed; nothing written."""
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "model_config.yaml").write_text((checkpoint / "model_config.yaml").read_text())
    text = evaluate("--checkpoint_dir", config_only, "--plan", "text", "--batch_size", "8", "--precision", "32-true")
    assert text.returncode == 0, text.stderr
    assert "tiny-eval evaluation, float32, batch 8: requests of up to 64 tokens (the context)" in text.stdout
    assert all(phase in text.stdout for phase in ("score", "prefill", "decode")) and "FITS in" in text.stdout
    plan = json.loads(evaluate("--checkpoint_dir", config_only, "--plan", "json", "--batch_size", "8",
                               "--precision", "32-true").stdout)
    assert plan["run"]["batch_size"] == 8 and plan["run"]["scored_length"] == BLOCK
    # KV cache of 8 sequences x the context: 2 layers x keys and values x 2 groups x 16 dims x 4 bytes a position
    assert plan["phase_categories"]["decode"]["kv_cache"] == 8 * BLOCK * 2 * 2 * 2 * 16 * 4
    assert plan["phase_categories"]["score"]["kv_cache"] == 0  # freed after generating
    assert list(config_only.iterdir()) == [config_only / "model_config.yaml"]

    small = evaluate("--checkpoint_dir", config_only, "--plan", "json", "--batch_size", "64", "--device_memory", "500MB")
    assert small.returncode == 1 and "does not fit in 0.50 GB" in one_paragraph(small.stderr)  # a GPU's context alone


def test_auto_batch_size_is_the_largest_the_plan_fits(checkpoint):
    from lit_model.plan.evaluation import auto_batch_size, plan_evaluation

    config = Config(**TINY)
    one = plan_evaluation(config, 1, "32-true", device_type="cpu", detect=False).peak_bytes
    four = plan_evaluation(config, 4, "32-true", device_type="cpu", detect=False).peak_bytes
    eight = plan_evaluation(config, 8, "32-true", device_type="cpu", detect=False).peak_bytes
    assert one < four < eight
    assert auto_batch_size(config, "32-true", None, (four + eight) // 2, "cpu") == 4
    assert auto_batch_size(config, "32-true", None, one - 1, "cpu") == 1  # none fits: 1, the scorer's to try
    assert auto_batch_size(config, "32-true", None, 10**15, "cpu") == 64  # at most 64


def test_auto_batch_size_starts_from_the_plan(checkpoint, tasks, tmp_path, monkeypatch):
    """--batch_size auto: the scoring batches start at the plan's size (halved only on running out of memory)."""
    from lit_model.infer.score import Scorer

    monkeypatch.setattr("lit_model.recipes.evaluate.auto_batch_size", lambda *args: 4)
    sizes, score_batch = [], Scorer._score_batch
    monkeypatch.setattr(Scorer, "_score_batch", lambda self, pairs: sizes.append(len(pairs)) or score_batch(self, pairs))
    result = evaluate("--checkpoint_dir", checkpoint, "--tasks", tasks["mc"], "--out_dir", tmp_path / "out",
                      "--batch_size", "auto")
    assert result.returncode == 0, result.stderr
    assert "--batch_size auto: 4 " in result.stderr and max(sizes) == 4 and len(sizes) > 1


@pytest.mark.parametrize("flags, code, message", [
    (("--devices", "2"), 2, "--devices 2 splits the model over several GPUs, and none is available"),
    (("--devices", "0"), 2, "--devices 0 must be at least 1"),
    (("--device_memory", "8GB"), 2, "--device_memory 8GB applies with --plan only"),
    (("--plan", "text", "--devices", "2"), 2, "Pass --devices 1"),
])
def test_devices_and_plan_flags_bad_input_is_one_paragraph(flags, code, message, checkpoint, tasks, tmp_path):
    if torch.cuda.is_available() and "2" in flags:
        pytest.skip("a GPU is here: --devices 2 is a real request")
    out = tmp_path / "out"
    result = evaluate("--checkpoint_dir", checkpoint, "--tasks", tasks["mc"], "--out_dir", out, *flags)
    assert result.returncode == code and message in one_paragraph(result.stderr), result.stderr
    assert not out.exists() and result.stdout == ""
