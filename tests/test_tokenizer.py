import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from lit_model.core.errors import UsageError, UserError
from lit_model.io.tokenizer import Tokenizer, train_bpe

# Text that trips up tokenizers that normalize: tabs, newlines, runs of spaces, leading space, non-ASCII
TEXTS = [
    "def f(x):\n\treturn x  +  1\n\n\n",
    "  leading and trailing spaces   ",
    "naïve café — 漢字 😀\r\nend",
    "<|endoftext|> in the middle <|endoftext|>",
    "",
]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    files = [STDLIB / name for name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    out_dir = tmp_path_factory.mktemp("bpe") / "tokenizer"
    train_bpe(files, vocab_size=512, out_dir=out_dir)
    return out_dir


def test_train_bpe_round_trips_exact_text(bpe_dir: Path) -> None:
    assert sorted(p.name for p in bpe_dir.parent.iterdir()) == ["tokenizer"]  # no temporary directory left
    assert sorted(p.name for p in bpe_dir.iterdir()) == [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tokenizer = Tokenizer(bpe_dir)
    assert tokenizer.backend == "huggingface"
    assert tokenizer.vocab_size == 512
    special = tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.bos_id == tokenizer.eos_id == special
    assert tokenizer.eos_ids == [special]
    assert not tokenizer.use_bos
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids.dtype == torch.long and ids.ndim == 1
        assert tokenizer.decode(ids) == text.replace("<|endoftext|>", "")  # special tokens are skipped
        with_specials = tokenizer.encode(text, bos=True, eos=True).tolist()
        assert with_specials[0] == with_specials[-1] == special
    ids = tokenizer.encode(TEXTS[0])
    assert len(ids) < len(TEXTS[0])  # merges were learned
    assert tokenizer.decode(ids.tolist()) == TEXTS[0]
    assert tokenizer.encode(TEXTS[0], max_length=3).tolist() == ids[:3].tolist()


def test_train_bpe_into_existing_dir_and_save(bpe_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("kept")
    tokenizer = train_bpe([STDLIB / "fnmatch.py"], vocab_size=300, out_dir=tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert tokenizer.vocab_size == 300

    Tokenizer(bpe_dir).save(tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(p.name for p in bpe_dir.iterdir())
    assert Tokenizer(tmp_path / "copy").encode(TEXTS[0]).tolist() == Tokenizer(bpe_dir).encode(TEXTS[0]).tolist()


@pytest.mark.parametrize("add_bos", [False, True])
def test_huggingface_matches_transformers(bpe_dir: Path, tmp_path: Path, add_bos: bool) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(bpe_dir / "tokenizer.json"),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        add_bos_token=add_bos,
    )
    reference.save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.use_bos == add_bos
    for text in TEXTS[:3]:  # transformers would not double a bos that the text itself starts with
        ids = tokenizer.encode(text).tolist()
        assert ids == reference.encode(text)
        assert tokenizer.encode(text, bos=False).tolist() == reference.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text

    # the configs train_bpe writes load in transformers with the same behaviour
    auto = AutoTokenizer.from_pretrained(bpe_dir)
    assert auto.bos_token == auto.eos_token == "<|endoftext|>"
    assert Tokenizer(bpe_dir).encode(TEXTS[2]).tolist() == auto.encode(TEXTS[2])


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sentencepiece

    tmp = tmp_path_factory.mktemp("sentencepiece")
    (tmp / "corpus.txt").write_text((STDLIB / "textwrap.py").read_text(encoding="utf-8"), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp / "corpus.txt"),
        model_prefix=str(tmp / "sp"),
        model_type="bpe",
        vocab_size=400,  # 256 byte-fallback pieces + characters + merges
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        byte_fallback=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    return tmp / "sp.model"


def test_sentencepiece_matches_processor(sentencepiece_model: Path, tmp_path: Path) -> None:
    import sentencepiece

    shutil.copy(sentencepiece_model, tmp_path / "tokenizer.model")
    tokenizer = Tokenizer(tmp_path)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    assert tokenizer.backend == "sentencepiece"
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.eos_ids) == (1, 2, [2])
    assert tokenizer.use_bos and tokenizer.vocab_size == 400
    code = (STDLIB / "shlex.py").read_text(encoding="utf-8")[:2000]
    for text in [code, *TEXTS[:3]]:
        ids = tokenizer.encode(text, eos=True).tolist()
        assert ids == [1, *processor.encode(text), 2]
        assert tokenizer.decode(ids) == text
    assert tokenizer.token_to_id("<unk>") == 0
    with pytest.raises(UserError, match="not in the vocabulary"):
        tokenizer.token_to_id("<|no such token|>")

    # transformers' SentencePiece wrapper gives the same ids (its decode does not rejoin byte-fallback pieces)
    from transformers import SentencePieceBackend

    reference = SentencePieceBackend(vocab_file=str(sentencepiece_model))
    assert tokenizer.encode(code, bos=False).tolist() == reference.encode(code)


def test_special_tokens_from_config_files(sentencepiece_model: Path, tmp_path: Path) -> None:
    shutil.copy(sentencepiece_model, tmp_path / "tokenizer.model")
    config = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    tokenizer = Tokenizer(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.eos_ids, tokenizer.use_bos) == (1, 5, [5, 2], False)
    assert tokenizer.encode("x")[0].item() != 1


def test_prefers_tokenizer_json(bpe_dir: Path, sentencepiece_model: Path, tmp_path: Path) -> None:
    shutil.copytree(bpe_dir, tmp_path, dirs_exist_ok=True)
    shutil.copy(sentencepiece_model, tmp_path / "tokenizer.model")
    assert Tokenizer(tmp_path).backend == "huggingface"


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="tokenizer.json or tokenizer.model, found nothing"):
        Tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="found config.json"):
        Tokenizer(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        Tokenizer(tmp_path / "missing")

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(UserError, match=r"tokenizer\.json: .*EOF") as error:
        Tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(error.value)

    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(UserError, match=r"tokenizer\.model"):
        Tokenizer(tmp_path)

    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(UserError, match=r"tokenizer_config\.json"):
        Tokenizer(tmp_path)

    with pytest.raises(UserError, match="missing: nope.txt"):
        train_bpe(["nope.txt"], vocab_size=300, out_dir=tmp_path / "bpe")
    with pytest.raises(UserError, match="at least 257"):
        train_bpe([tmp_path / "config.json"], vocab_size=100, out_dir=tmp_path / "bpe")
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    with pytest.raises(UserError, match="UTF-8"):
        train_bpe([tmp_path / "latin1.txt"], vocab_size=300, out_dir=tmp_path / "bpe")
    assert not (tmp_path / "bpe").exists()


def test_text_that_is_not_utf8_is_named_not_a_backend_traceback(bpe_dir: Path, sentencepiece_model: Path,
                                                                 tmp_path: Path) -> None:
    shutil.copy(sentencepiece_model, tmp_path / "tokenizer.model")
    for tokenizer in (Tokenizer(bpe_dir), Tokenizer(tmp_path)):
        # "\udcff" is how Python keeps the byte 0xff of a command line (or UTF-8 mode's stdin) that is not UTF-8
        with pytest.raises(UsageError, match=r"The text to encode is not UTF-8 text \(byte 0xff at character 3\)"):
            tokenizer.encode("abc\udcff")
        assert tokenizer.decode(tokenizer.encode("abc\u00ff")) == "abc\u00ff"  # a real ÿ is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="Tokenizer directory .*file is a file, not a directory"):
        Tokenizer(tmp_path / "file")
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match=r"Could not read .*tokenizer_config\.json: maximum recursion depth"):
        Tokenizer(tmp_path)
