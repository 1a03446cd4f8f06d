import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from lit_model import GPT, Config
from lit_model.kernels import ops
from lit_model.io.checkpoint import lit_state_dict, save_checkpoint_dir
from lit_model.core.errors import UsageError, UserError
from lit_model.infer.decode import check_lengths, forward_last, generate
from lit_model.infer.chat import ChatSession
from lit_model.infer.engine import Generator, Sampling
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE
from lit_model.infer.kv_cache import kv_cache_nbytes, set_kv_cache
from lit_model.infer.load import Precision, load_model
from lit_model.infer.sampling import make_generator, sample
from lit_model.infer.stream import TextStream
from lit_model.kernels.ops import use_aten_gemv
from lit_model.io.prompts import STYLES, PromptStyle
from lit_model.io.tokenizer import Tokenizer, train_bpe
from lit_model.methods.load import load_gpt

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TINY = dict(name="tiny", block_size=256, vocab_size=300, n_layer=2, n_embd=32, n_head=4, n_query_groups=2)
# Gemma-2-like: local attention on every other layer, soft-capped attention scores and logits
LOCAL_SOFTCAP = dict(
    TINY, name="tiny-local-softcap", sliding_window_size=4, sliding_window_layer_stride=2,
    attention_logit_softcapping=20.0, final_logit_softcapping=10.0, post_attention_norm=True, post_mlp_norm=True,
    norm_unit_offset=True, scale_embeddings=True, mlp_class_name="GemmaMLP",
)


FP32 = Precision("32-true", torch.float32, autocast=None)


def greedy(model: GPT) -> Generator:
    """The inference engine over an fp32 ``model``, decoding greedily."""
    return Generator(model, FP32, Sampling(temperature=0))


def greedy_chat(model: GPT, tokenizer: Tokenizer, style: PromptStyle, max_length: int) -> ChatSession:
    return ChatSession(model, FP32, Sampling(temperature=0), tokenizer, style, max_length)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0, **fields) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(**{**TINY, **fields}))
    model.init_weights()
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("bpe") / "tokenizer"
    train_bpe([STDLIB / "textwrap.py", STDLIB / "shlex.py"], vocab_size=300, out_dir=out_dir)
    return out_dir


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    model = tiny_model()
    out_dir = tmp_path_factory.mktemp("ckpt") / "tiny"
    return save_checkpoint_dir(lit_state_dict(model, model.config), model.config, out_dir, tokenizer_dir=tokenizer_dir)


def greedy_without_cache(model: GPT, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.tolist()
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def run(script: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LIT_MODEL_DEBUG", None)
    proc = subprocess.run(  # bytes in and out: no newline translation of generated text
        [sys.executable, str(ROOT / script), *args], input=stdin.encode(), capture_output=True, env=env, timeout=300
    )
    proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    return proc


# ---- decoding ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [{}, LOCAL_SOFTCAP], ids=["llama-like", "sliding-window-softcap"])
def test_greedy_with_kv_cache_equals_full_recomputation(fields: dict) -> None:
    model = tiny_model(**fields)
    prompt = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(1))
    expected = greedy_without_cache(model, prompt, 12)
    result = generate(model, prompt, 12, temperature=0)
    assert result.tokens == [expected]
    assert result.steps == 12 and result.end_pos == 7 + 12 - 1
    # batched samples share one cache and decode the same tokens
    assert generate(model, prompt, 12, temperature=0, num_samples=3).tokens == [expected] * 3
    # forward_last is the model's forward at the last position
    set_kv_cache(model, 1, 7)
    with torch.no_grad():
        torch.testing.assert_close(forward_last(model, prompt[None], torch.arange(7)), model(prompt[None])[:, -1])


@pytest.mark.parametrize(
    "fields", [{}, dict(sliding_window_size=4), LOCAL_SOFTCAP], ids=["llama-like", "sliding-window", "softcap"]
)
def test_decoding_over_the_filled_cache_equals_masking_the_whole_cache(fields: dict) -> None:
    """With ``input_pos_maxp1`` attention reads only the written positions and leaves out the mask where the
    shapes imply it: the same logits for a prefill at 0, a chat turn after it and single steps past the window."""
    model = tiny_model(**fields)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    chunks = [(0, 6), (6, 9), (9, 10), (10, 11), (11, 12)]
    outputs = {}
    for filled_only in (False, True):
        set_kv_cache(model, 1, 16)
        with torch.no_grad():
            outputs[filled_only] = [
                forward_last(model, ids[:, a:b], torch.arange(a, b), b if filled_only else None) for a, b in chunks
            ]
    for masked, filled in zip(outputs[False], outputs[True]):
        torch.testing.assert_close(filled, masked)


def test_bfloat16_batch_one_decoding_bypasses_onednn_and_restores_it() -> None:
    model = tiny_model().to(torch.bfloat16)
    assert use_aten_gemv(model, batch=1) and not use_aten_gemv(model, batch=2)
    assert not use_aten_gemv(tiny_model(), batch=1)  # float32 matmuls never run on oneDNN here
    prompt = torch.tensor([3, 1, 4, 1, 5])
    seen: list[bool] = []
    record = lambda row, token: seen.append(torch.backends.mkldnn.enabled)  # noqa: E731
    result = generate(model, prompt, 6, temperature=0, on_token=record)
    assert len(result.tokens[0]) == 6 and seen == [False] * 6 and torch.backends.mkldnn.enabled


def test_eos_and_stop_sequences_end_a_sample() -> None:
    model = tiny_model()
    prompt = torch.tensor([5, 6, 7])
    full = generate(model, prompt, 10, temperature=0).tokens[0]
    assert generate(model, prompt, 10, temperature=0, eos_ids=[full[3]]).tokens[0] == full[: full.index(full[3])]
    streamed: list[int] = []
    result = generate(model, prompt, 10, temperature=0, stop_sequences=[full[4:6]],
                      on_token=lambda row, token: streamed.append(token))
    assert result.tokens[0] == streamed == full[:4] and result.stopped == [True]
    stopped_by_callback = generate(model, prompt, 10, temperature=0, on_token=lambda row, token: token == full[2])
    assert stopped_by_callback.tokens[0] == full[:3] and stopped_by_callback.steps == 3


def test_sampling_top_k_one_is_greedy_and_seeds_reproduce() -> None:
    model = tiny_model()
    prompt = torch.tensor([1, 2, 3, 4])
    greedy = generate(model, prompt, 8, temperature=0).tokens
    top1 = generate(model, prompt, 8, temperature=1.5, top_k=1, generator=make_generator(3, "cpu")).tokens
    assert top1 == greedy
    draw = lambda seed: generate(  # noqa: E731
        model, prompt, 8, temperature=1.0, top_k=50, top_p=0.9, num_samples=2, generator=make_generator(seed, "cpu")
    ).tokens
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    # top_p keeps the smallest set of most likely tokens that covers p: here only token 3 (p=0.64 > 0.5)
    assert {int(sample(logits, 1.0, None, 0.5, make_generator(i, "cpu"))) for i in range(20)} == {3}
    assert {int(sample(logits, 1.0, 2, 1.0, make_generator(i, "cpu"))) for i in range(40)} == {2, 3}


def test_kv_cache_is_sized_by_prompt_plus_new_tokens_not_block_size(checkpoint_dir: Path) -> None:
    prompt, new, batch = torch.tensor([1, 2, 3, 4, 5]), 7, 2
    for block_size in (256, 4096):
        model = tiny_model(block_size=block_size)
        generate(model, prompt, new, temperature=0, num_samples=batch)
        c = model.config
        assert kv_cache_nbytes(model) == 2 * c.n_layer * batch * c.n_query_groups * (5 + new) * c.head_size * 4
    model = load_model(checkpoint_dir, dtype=torch.bfloat16, max_seq_length=12)
    assert model.cos.shape[0] == 12 and model.embed.weight.dtype == torch.bfloat16
    generate(model, prompt, new, temperature=0)
    assert kv_cache_nbytes(model) == 2 * 2 * 1 * 2 * 12 * 8 * 2


def test_loaded_checkpoint_generates_like_the_model(checkpoint_dir: Path) -> None:
    prompt = torch.tensor([9, 8, 7])
    loaded = load_model(checkpoint_dir, dtype=torch.float32, max_seq_length=20)
    assert generate(loaded, prompt, 10, temperature=0).tokens == generate(tiny_model(), prompt, 10, temperature=0).tokens


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch's BLAS is not MKL")
def test_fp32_decoding_on_mkl_off_intel_reads_column_major_weights_with_the_same_logits(checkpoint_dir: Path,
                                                                                        monkeypatch) -> None:
    prompt = torch.tensor([9, 8, 7, 6])
    reference = tiny_model()
    set_kv_cache(reference, 1, 20)
    expected = forward_last(reference, prompt[None], torch.arange(4), 4)
    for vendor, column_major in (("AuthenticAMD", True), ("GenuineIntel", False)):
        monkeypatch.setattr(ops, "_cpu_vendor", lambda vendor=vendor: vendor)
        loaded = load_model(checkpoint_dir, dtype=torch.float32, max_seq_length=20, decoding=True)
        linears = [m for m in loaded.modules() if isinstance(m, torch.nn.Linear)]
        assert len(linears) == 1 + 7 * loaded.config.n_layer
        for module in linears:  # read straight into that layout (no row-major copy made and freed)
            assert module.weight.t().is_contiguous() is column_major and not module.weight.requires_grad
        assert loaded.embed.weight.is_contiguous()
        torch.testing.assert_close(loaded.state_dict(), reference.state_dict(), rtol=0, atol=0)
        set_kv_cache(loaded, 1, 20)
        torch.testing.assert_close(forward_last(loaded, prompt[None], torch.arange(4), 4), expected,
                                   rtol=1e-5, atol=1e-5)
        assert generate(loaded, prompt, 10, temperature=0).tokens == generate(reference, prompt, 10, temperature=0).tokens
    monkeypatch.setattr(ops, "_cpu_vendor", lambda: "AuthenticAMD")
    bf16 = load_model(checkpoint_dir, dtype=torch.bfloat16, max_seq_length=20, decoding=True)  # ATen's kernel reads rows
    to_train = load_model(checkpoint_dir, dtype=torch.float32, max_seq_length=20)  # fine-tuning (FSDP shards rows)
    for model in (bf16, to_train):
        assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_length_errors_name_the_limit() -> None:
    config = Config(**TINY)
    assert check_lengths(56, 200, config) == 256
    with pytest.raises(UsageError, match="at most 200 new tokens fit. Pass --max_new_tokens 200"):
        check_lengths(56, 201, config)
    with pytest.raises(UsageError, match="The prompt is 300 tokens long.*context of 256"):
        check_lengths(300, 1, config)


# ---- streaming text --------------------------------------------------------------------------------------
def test_text_stream_waits_for_complete_characters_and_holds_back_stop_strings(tokenizer_dir: Path) -> None:
    tokenizer = Tokenizer(tokenizer_dir)
    text = "naïve café — 漢字 😀 def f(x):\n\treturn x"
    ids = tokenizer.encode(text).tolist()
    pieces: list[str] = []
    stream = TextStream(tokenizer, write=pieces.append)
    for token in ids:
        assert not stream.add(token)
    assert stream.finish() == text == "".join(pieces)
    assert all("\ufffd" not in piece for piece in pieces) and len(pieces) > 5

    pieces.clear()
    stream = TextStream(tokenizer, stop=["return"], write=pieces.append)
    stopped = [stream.add(token) for token in ids]
    assert stopped[-1] and stream.finish() == "".join(pieces) == text[: text.index("return")]


def test_text_stream_keeps_sentencepiece_spaces(tmp_path: Path) -> None:
    sentencepiece = pytest.importorskip("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(
        input=str(STDLIB / "textwrap.py"), model_prefix=str(tmp_path / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2,
    )
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.backend == "sentencepiece"
    ids = tokenizer.encode("Hello world  naïve 漢字 😀 end", bos=False).tolist()
    for split in (2, 3, 5):  # the first new token may or may not start a word ("▁world")
        pieces: list[str] = []
        stream = TextStream(tokenizer, context=ids[:split], write=pieces.append)
        for token in ids[split:]:
            stream.add(token)
        stream.finish()
        full, prompt = tokenizer.decode(ids), tokenizer.decode(ids[:split])
        assert "".join(pieces) == full[len(prompt):] and all("\ufffd" not in piece for piece in pieces)


# ---- chat ----------------------------------------------------------------------------------------------------
def test_chat_keeps_the_conversation_in_the_kv_cache(checkpoint_dir: Path) -> None:
    tokenizer = Tokenizer(checkpoint_dir)
    model = load_model(checkpoint_dir, dtype=torch.float32, max_seq_length=256)
    style = PromptStyle.from_name("chatml")
    session = greedy_chat(model, tokenizer, style, 256)
    first = session.send("def add(a, b):", 6)
    after_first = list(session.tokens)
    assert after_first[: -len(session.last.tokens)] == tokenizer.encode(style.apply("def add(a, b):")).tolist()
    assert session.last_start_pos == 0  # nothing to share yet
    session.send("return a + b", 6)
    # the second turn shared every full block of the first (all of it but its last sampled token, never fed back,
    # in whole blocks), and computed only the rest ...
    assert session.last_start_pos == (len(after_first) - 1) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE > 0
    prompt = session.tokens[: len(session.tokens) - len(session.last.tokens)]
    assert prompt == after_first + tokenizer.encode(style.next_turn("return a + b"), bos=False).tolist()
    # ... and continues exactly as a single pass over the whole conversation would
    fresh = load_model(checkpoint_dir, dtype=torch.float32, max_seq_length=256)
    assert generate(fresh, torch.tensor(prompt), 6, temperature=0).tokens == [list(session.last.tokens)]
    # /reset: the next message starts a new conversation, which may share the blocks of one that began alike
    session.reset()
    assert session.send("def add(a, b):", 6) == first and session.turns == 1
    assert session.engine.stats().free_blocks == session.engine.stats().total_blocks  # nothing held between turns


def test_chat_starts_over_when_the_context_would_overflow(checkpoint_dir: Path) -> None:
    tokenizer = Tokenizer(checkpoint_dir)
    model = load_model(checkpoint_dir, dtype=torch.float32, max_seq_length=40)
    session = greedy_chat(model, tokenizer, PromptStyle.from_name("default"), 40)
    notices: list[str] = []
    session.send("def f(x):", 8, notify=notices.append)
    session.send("return x", 8, notify=notices.append)
    assert notices == [] and session.turns == 2
    session.send("import os, sys", 20, notify=notices.append)
    assert len(notices) == 1 and "starting over" in notices[0] and session.turns == 1
    assert session.tokens[:-len(session.last.tokens)] == tokenizer.encode("import os, sys").tolist()
    with pytest.raises(UserError, match="does not fit the context of 40 tokens"):
        session.send("x" * 200, 8)
    assert session.turns == 1  # the failed message left the conversation as it was


def test_chat_script_reads_piped_input_until_exit(checkpoint_dir: Path) -> None:
    messages = ["hello there", "and then?", "/reset", "hello there", "/exit", "never read"]
    proc = run("generate/chat.py", "--checkpoint_dir", str(checkpoint_dir), "--max_new_tokens", "5",
               "--temperature", "0", "--precision", "32-true", stdin="\n".join(messages) + "\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "conversation reset" in proc.stderr
    model = load_model(checkpoint_dir, dtype=torch.float32, max_seq_length=256)
    tokenizer = Tokenizer(checkpoint_dir)
    session = greedy_chat(model, tokenizer, PromptStyle.from_checkpoint(checkpoint_dir), 256)
    first, second = session.send("hello there", 5), session.send("and then?", 5)
    assert proc.stdout == f"{first}\n{second}\n{first}\n"


# ---- generate/base.py ------------------------------------------------------------------------------------
def test_base_script_streams_text_and_reports_speed_and_memory(checkpoint_dir: Path) -> None:
    proc = run("generate/base.py", "--checkpoint_dir", str(checkpoint_dir), "--prompt", "def f(x):",
               "--max_new_tokens", "8", "--temperature", "0", "--precision", "32-true")
    assert proc.returncode == 0, proc.stderr
    model, tokenizer = load_model(checkpoint_dir, max_seq_length=256), Tokenizer(checkpoint_dir)
    tokens = generate(model, tokenizer.encode("def f(x):"), 8, temperature=0, eos_ids=tokenizer.eos_ids).tokens[0]
    assert proc.stdout == tokenizer.decode(tokens) + "\n"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "time to first token" in lines[0] and "tokens/s" in lines[0]
    assert "peak memory" in lines[0]


def test_base_script_generates_several_prompts_together(checkpoint_dir: Path, tmp_path: Path) -> None:
    """Repeated --prompt and --prompts_file run through continuous batching: each output equals the prompt's own
    greedy generation, in the order given."""
    texts = ["def f(x):", "import os", "class A:\n    pass"]
    model, tokenizer = load_model(checkpoint_dir, max_seq_length=256), Tokenizer(checkpoint_dir)
    expected = "".join(
        f"--- prompt {i + 1} ---\n"
        f"{tokenizer.decode(generate(model, tokenizer.encode(t), 8, temperature=0, eos_ids=tokenizer.eos_ids).tokens[0])}\n"
        for i, t in enumerate(texts))
    flags = ["--max_new_tokens", "8", "--temperature", "0", "--precision", "32-true"]
    proc = run("generate/base.py", "--checkpoint_dir", str(checkpoint_dir), *flags,
               *[arg for t in texts for arg in ("--prompt", t)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected
    assert "3 sequences" in proc.stderr and "tokens/s" in proc.stderr
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("def f(x):\n\nimport os\n")
    proc = run("generate/base.py", "--checkpoint_dir", str(checkpoint_dir), *flags, "--prompts_file", str(prompts_file))
    assert proc.returncode == 0 and proc.stdout == expected.split("--- prompt 3")[0]
    proc = run("generate/base.py", "--checkpoint_dir", str(checkpoint_dir), "--prompts_file", str(prompts_file),
               "--prompt", "x")
    assert proc.returncode == 2 and "not both" in proc.stderr and proc.stdout == ""


def test_base_script_errors_are_one_paragraph_without_traceback(checkpoint_dir: Path, tmp_path: Path) -> None:
    proc = run("generate/base.py", "--checkpoint_dir", str(tmp_path / "missing"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "does not exist" in " ".join(proc.stderr.split()) and proc.stdout == ""
    prompt_length = len(Tokenizer(checkpoint_dir).encode("def f(x):"))
    proc = run("generate/base.py", "--checkpoint_dir", str(checkpoint_dir), "--prompt", "def f(x):",
               "--max_new_tokens", "1000", "--quantize", "bnb.nf4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"Pass --max_new_tokens {256 - prompt_length}" in " ".join(proc.stderr.split())


# ---- --plan ------------------------------------------------------------------------------------------------
def test_plan_json_reads_no_weights_and_its_kv_cache_grows_with_max_new_tokens(checkpoint_dir: Path,
                                                                               tmp_path: Path) -> None:
    no_weights = tmp_path / "no_weights"
    shutil.copytree(checkpoint_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    prompt_length = len(Tokenizer(checkpoint_dir).encode("def f(x):"))
    c = Config.from_checkpoint(checkpoint_dir)
    plans = {}
    for new in (10, 100):
        proc = run("generate/base.py", "--checkpoint_dir", str(no_weights), "--prompt", "def f(x):", "--plan", "json",
                   "--max_new_tokens", str(new), "--num_samples", "2", "--precision", "32-true")
        assert proc.returncode == 0, proc.stderr
        plans[new] = json.loads(proc.stdout)
        assert {"peak_bytes", "by_category", "by_phase", "fits", "suggestions"} <= set(plans[new])
        # keys and values of every layer, for prompt + new positions of both samples, in float32
        kv_cache, positions = plans[new]["by_category"]["kv_cache"], prompt_length + new
        assert kv_cache == 2 * c.n_layer * 2 * c.n_query_groups * positions * c.head_size * 4
        assert plans[new]["peak_bytes"] == max(plans[new]["by_phase"].values())
    assert plans[100]["peak_bytes"] > plans[10]["peak_bytes"]
    proc = run("generate/chat.py", "--checkpoint_dir", str(no_weights), "--plan", "json", "--max_seq_length", "64",
               "--max_new_tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["by_category"]["kv_cache"] == 2 * c.n_layer * c.n_query_groups * 64 * c.head_size * 4


def test_plan_from_a_model_name_says_7b_does_not_fit_10gb_and_suggests_quantize() -> None:
    proc = run("generate/base.py", "--model_name", "Llama-2-7b-hf", "--device_memory", "10GB", "--plan", "text")
    assert proc.returncode == 0, proc.stderr
    assert "DOES NOT FIT in 10.00 GB" in proc.stdout and "--quantize bnb.nf4" in proc.stdout
    proc = run("generate/chat.py", "--model_name", "Llama-2-7b-hf", "--device_memory", "10GB", "--plan", "json")
    plan = json.loads(proc.stdout)
    assert not plan["fits"] and any(flag.startswith("--quantize") for s in plan["suggestions"] for flag in s["flags"])
    proc = run("generate/base.py", "--model_name", "Llama-2-7b-hf", "--device_memory", "10GB", "--plan", "text",
               "--devices", "2", "--precision", "bf16-true")  # the blocks split over two GPUs
    assert proc.returncode == 0 and "FITS in 10.00 GB" in proc.stdout and "the fullest of them" in proc.stdout
    proc = run("generate/base.py", "--model_name", "Llama-2-7b-hf")  # generating needs the weights
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "`lit-model download meta-llama/Llama-2-7b-hf`" in " ".join(proc.stderr.split())


def test_the_end_of_run_sample_is_skipped_when_it_would_not_fit(checkpoint_dir: Path, monkeypatch) -> None:
    from types import SimpleNamespace

    import lit_model.recipes.common
    from lit_model.recipes.common import sample_text

    rank0, tokenizer = SimpleNamespace(global_rank=0), Tokenizer(checkpoint_dir)
    assert sample_text(rank0, checkpoint_dir, tokenizer, "def f(x):", max_new_tokens=8)  # it fits: a continuation
    monkeypatch.setattr(lit_model.recipes.common, "detect_device_memory", lambda device_type: 1000)
    note = sample_text(rank0, checkpoint_dir, tokenizer, "def f(x):", max_new_tokens=8)
    assert note.startswith(f"[no sample: generating from {checkpoint_dir} in fp32 takes about") and "is free" in note


def test_plan_a_custom_architecture_from_model_config(tmp_path: Path) -> None:
    custom = tmp_path / "custom.yaml"
    custom.write_text("name: custom\nblock_size: 128\nvocab_size: 256\nn_layer: 3\nn_embd: 64\nn_head: 4\n")
    proc = run("generate/base.py", "--model_config", str(custom), "--plan", "json", "--prompt_length", "16",
               "--max_new_tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["run"]["model"] == "custom"
    proc = run("generate/base.py", "--model_config", str(custom))  # generating reads a checkpoint
    assert proc.returncode == 2 and "--plan" in proc.stderr and "Traceback" not in proc.stderr


# ---- quantization ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.int8"])
def test_quantized_models_generate_on_cpu_with_fewer_bytes(checkpoint_dir: Path, mode: str) -> None:
    pytest.importorskip("bitsandbytes")
    from lit_model.methods.quantize import is_quantized, quantized_nbytes

    full = load_model(checkpoint_dir, dtype=torch.float32)
    model = load_model(checkpoint_dir, dtype=torch.float32, quantize=mode)
    linears = [name for name, m in model.named_modules() if is_quantized(m)]
    assert len(linears) == 2 * 7 and "lm_head" not in linears  # q, k, v, proj, fc_1, fc_2, proj per block
    assert quantized_nbytes(model.blocks) < quantized_nbytes(full.blocks) / 2
    prompt = torch.tensor([3, 4, 5, 6])
    set_kv_cache(model, 1, 12)
    with torch.no_grad():
        logits = forward_last(model, prompt[None], torch.arange(4))
    assert torch.isfinite(logits).all()
    result = generate(model, prompt, 8, temperature=0)
    assert result.steps == 8 and len(result.tokens[0]) == 8


def test_quantize_model_replaces_linear_layers_of_a_built_model() -> None:
    pytest.importorskip("bitsandbytes")
    from lit_model.methods.quantize import check_quantize, is_quantized, quantize_model

    model = tiny_model(n_embd=64).to(torch.bfloat16)  # widths that bitsandbytes' packed CPU kernels take
    quantize_model(model, "bnb.nf4-dq")
    assert is_quantized(model.blocks[0].attn.query) and not is_quantized(model.lm_head)
    assert isinstance(model.embed, torch.nn.Embedding)
    assert len(generate(model, torch.tensor([1, 2]), 4, temperature=0).tokens[0]) == 4
    with pytest.raises(UsageError, match="bnb.int8 computes in float16 on CUDA"):
        check_quantize("bnb.int8", "cuda", torch.bfloat16)
    with pytest.raises(UsageError, match="Choose one of"):
        check_quantize("int4", "cpu", torch.float32)


# ---- Hugging Face parity -------------------------------------------------------------------------------
def test_converted_hf_llama_matches_transformers_greedy(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    try:
        from lit_model.io.convert import hf_to_lit
    except ImportError:
        pytest.skip("lit_model.io.convert.hf_to_lit is not available yet")
    hf_config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    hf_to_lit(str(tmp_path / "hf"), str(tmp_path / "lit"))
    model = load_gpt(tmp_path / "lit")
    prompt = torch.tensor([[11, 22, 33, 44, 55, 66]])
    with torch.no_grad():
        expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert generate(model, prompt[0], 12, temperature=0).tokens[0] == expected[0, 6:].tolist()


# ---- prompt styles -----------------------------------------------------------------------------------------
def test_prompt_styles() -> None:
    assert PromptStyle.from_config(Config(**{**TINY, "name": "Llama-3.2-1B-Instruct"})).name == "llama-3"
    for name, style in [("Qwen2.5-0.5B-Instruct", "qwen2.5"), ("SmolLM2-135M-Instruct", "chatml"),
                        ("Llama-2-7b-chat-hf", "llama-2"), ("gemma-2-2b-it", "gemma"), ("phi-2", "phi-2"),
                        ("Phi-3-mini-4k-instruct", "phi-3"), ("Mistral-7B-Instruct-v0.2", "mistral"),
                        ("TinyLlama-1.1B-Chat-v1.0", "tinyllama"), ("Llama-3.2-1B", "default"), ("tiny", "default")]:
        assert PromptStyle.from_config(name).name == style, name
    with pytest.raises(UsageError, match="Choose one of: default, alpaca"):
        PromptStyle.from_name("vicuna")
    assert PromptStyle.from_name("default").apply("plain text") == "plain text"
    llama3 = PromptStyle.from_name("llama-3")
    assert llama3.apply("Hi", system="Be brief.") == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert PromptStyle.from_name("llama-2").apply("Hi", system="S") == "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST]"
    assert "### Input:\nxyz" in STYLES["alpaca"].apply("Sort it", input="xyz")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    for style in STYLES.values():  # a chat built turn by turn renders exactly like the whole conversation
        assert style.apply_chat(messages) == style.turn("a", system="S") + "b" + style.next_turn("c"), style.name
