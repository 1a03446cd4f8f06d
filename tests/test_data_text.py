import json
import math
import os
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import lit_model.data.instruct as instruct
import lit_model.data.text as text
from lit_model.data.text import (
    GlobalBatchSampler,
    PackedDataset,
    default_tokenizer,
    load_pretrain_data,
    split_by_file,
    stdlib_sources,
    tokenize_files,
    unigram_loss,
)
from lit_model.core.errors import UsageError, UserError
from lit_model.io.tokenizer import Tokenizer, train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_FILES = [STDLIB / name for name in ("bisect.py", "colorsys.py", "keyword.py", "fnmatch.py")]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LIT_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("bpe") / "tokenizer"
    train_bpe(SMALL_FILES, vocab_size=300, out_dir=out_dir)
    return out_dir


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)  # a fresh instance per test: tests wrap its encode to count calls


def count_encode_calls(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    encode = tokenizer.encode

    def counting(text: str, *args, **kwargs) -> torch.Tensor:
        calls.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    return calls


def write_corpus(directory: Path, encoding: str = "latin-1") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    (directory / "b.md").write_text("# Title\n\nSome prose about lists and dicts.\n" * 40)
    (directory / "c.txt").write_bytes(f"caf\xe9 in {encoding}\n".encode(encoding) * 30)  # latin-1: not UTF-8
    (directory / "d.jsonl").write_text("\n".join(json.dumps({"text": f"record {i}: x = {i}"}) for i in range(30)))
    return sorted(directory.iterdir())


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert text.cache_root() == tmp_path / "cache"
    monkeypatch.delenv("LIT_MODEL_CACHE")
    assert text.cache_root() == Path.home() / ".cache" / "lit-model"


def test_stdlib_sources_and_split_by_file() -> None:
    files = stdlib_sources()
    assert len(files) > 500 and files == sorted(files)
    assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)
    train, val = split_by_file(files)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(files)
    assert 0.02 < len(val) / len(files) < 0.1
    # Deterministic and independent of order and of the other files
    assert split_by_file(list(reversed(files)), root=STDLIB) == (train, val)
    assert split_by_file(files[:200], root=STDLIB)[1] == [f for f in val if f in files[:200]]
    for pair in ([files[0], files[1]], SMALL_FILES):
        train, val = split_by_file(pair, val_fraction=0.05)
        assert val and train and len(train) + len(val) == len(pair)
    assert split_by_file([files[0]]) == ([files[0]], [])
    with pytest.raises(UsageError, match="val_fraction"):
        split_by_file(files, val_fraction=1.0)


def test_packed_dataset_windows_and_shifted_targets() -> None:
    for tokens in (np.arange(23, dtype=np.uint16), torch.arange(23)):
        dataset = PackedDataset(tokens, seq_length=5)
        assert len(dataset) == 4  # (23 - 1) // 5: windows of 6 tokens with stride 5, the rest dropped
        for i in range(4):
            x, y = dataset[i]
            assert x.dtype == y.dtype == torch.int64
            assert x.tolist() == list(range(5 * i, 5 * i + 5))
            assert y.tolist() == list(range(5 * i + 1, 5 * i + 6))
        with pytest.raises(IndexError):
            dataset[4]
    assert len(PackedDataset(np.arange(5), seq_length=5)) == 0
    assert len(PackedDataset(np.arange(6), seq_length=5)) == 1


def test_tokenize_files_caches_and_reuses(tokenizer: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    files = write_corpus(tmp_path / "corpus")
    with pytest.raises(UserError, match=r"c\.txt is not UTF-8 text \(byte 0xe9.*iconv"):
        tokenize_files(files, tokenizer, tmp_path / "tokens", "corpus")  # user data: UTF-8 or a message
    assert [p.suffix for p in (tmp_path / "tokens").iterdir()] == [".lock"]  # no array, no temporary file left
    calls = count_encode_calls(tokenizer, monkeypatch)
    tokens = tokenize_files(reversed(files), tokenizer, tmp_path / "tokens", "corpus", errors="replace")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and not tokens.flags.writeable
    assert len(calls) == 3 + 30  # three text files and 30 JSON records, each encoded once

    # Sorted files, eos after every document; the latin-1 file decoded with replacement characters (the stdlib's mode)
    expected = []
    for path in files:
        docs = [json.loads(l)["text"] for l in path.read_text().splitlines()] if path.suffix == ".jsonl" else [
            path.read_text(errors="replace")
        ]
        expected += [tokenizer.encode(doc, eos=True) for doc in docs]
    assert tokens.tolist() == torch.cat(expected).tolist()
    assert (tokens == tokenizer.eos_id).sum() == 33
    assert "\ufffd" in tokenizer.decode(np.asarray(tokens, dtype=np.int64))

    (cached,) = (tmp_path / "tokens").glob("corpus-*.bin")
    mtime, n_calls = cached.stat().st_mtime_ns, len(calls)
    again = tokenize_files(files, tokenizer, tmp_path / "tokens", "corpus", errors="replace")
    assert np.array_equal(again, tokens) and isinstance(again, np.memmap)
    assert len(calls) == n_calls and cached.stat().st_mtime_ns == mtime  # read back, not re-tokenized
    assert sorted(p.name[len(cached.name):] for p in (tmp_path / "tokens").glob(f"{cached.name}*")) == [
        "", ".json", ".lock"]  # the array, its record and its lock
    assert not list((tmp_path / "tokens").glob(".*"))  # no temporary file left
    assert json.loads((tmp_path / "tokens" / f"{cached.name}.json").read_text())["tokens"] == len(tokens)

    # A .json file may hold a list of records
    (tmp_path / "list.json").write_text(json.dumps([{"text": "first"}, {"text": "second"}]))
    records = tokenize_files([tmp_path / "list.json"], tokenizer, tmp_path / "tokens", "list")
    assert records.tolist() == torch.cat([tokenizer.encode(t, eos=True) for t in ("first", "second")]).tolist()

    # A changed file gets a new cache entry
    files[0].write_text("changed\n")
    changed = tokenize_files(files, tokenizer, tmp_path / "tokens", "corpus", errors="replace")
    assert len(changed) < len(tokens) and len(list((tmp_path / "tokens").glob("corpus-*.bin"))) == 2


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _shuffle(path: Path) -> None:  # same bytes, same size, other order: only the checksum notices
    tokens = np.fromfile(path, dtype=np.uint16)
    np.random.default_rng(0).permutation(tokens).tofile(path)


@pytest.mark.parametrize("damage, problem", [
    (lambda path: os.truncate(path, 14), "has 14 bytes where its record says"),  # 7 tokens left
    (lambda path: os.truncate(path, 15), "has 15 bytes where its record says"),  # not even whole tokens
    (lambda path: path.write_bytes(b""), "has 0 bytes where its record says"),
    (_flip, "does not match its SHA-256"),
    (_shuffle, "does not match its SHA-256"),
    (lambda path: Path(f"{path}.json").unlink(), "has no record of its size and checksum"),
    (lambda path: Path(f"{path}.json").write_text('{"size": '), "has an unreadable record"),
    (lambda path: Path(f"{path}.json").write_text(json.dumps({**json.loads(Path(f"{path}.json").read_text()),
                                                             "tokens": 7})), "has a damaged record"),
])
def test_damaged_token_cache_is_rebuilt_with_a_warning(damage, problem, tokenizer: Tokenizer, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    files = write_corpus(tmp_path / "corpus", encoding="utf-8")
    fresh = np.array(tokenize_files(files, tokenizer, tmp_path / "tokens", "corpus"))
    (cached,) = (tmp_path / "tokens").glob("corpus-*.bin")
    assert len(fresh) > 100 and len(np.unique(fresh)) > 10  # a shuffle changes the order
    capsys.readouterr()
    damage(cached)
    rebuilt = tokenize_files(files, tokenizer, tmp_path / "tokens", "corpus")
    assert rebuilt.tolist() == fresh.tolist()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: the cache {cached} {problem}")
    assert warnings[0].endswith("; rebuilding it.")
    mtime = cached.stat().st_mtime_ns  # and the rebuilt cache is trusted again: read, not rebuilt
    assert tokenize_files(files, tokenizer, tmp_path / "tokens", "corpus").tolist() == fresh.tolist()
    assert cached.stat().st_mtime_ns == mtime and "warning" not in capsys.readouterr().err


def test_instruction_cache_is_checked_like_the_token_cache(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    # the default instruction records from a few stdlib files (the whole stdlib takes seconds)
    monkeypatch.setattr(instruct, "stdlib_sources", lambda: SMALL_FILES)
    train, val = instruct.stdlib_instructions()
    (path,) = (cache / "instruct").glob("*.jsonl")
    assert len(train) + len(val) == json.loads(Path(f"{path}.json").read_text())["records"] > 3
    path.write_bytes(path.read_bytes()[:-50])  # a truncated last line: a JSON error or a lost record before
    capsys.readouterr()
    assert instruct.stdlib_instructions() == (train, val)
    assert capsys.readouterr().err.startswith(f"warning: the cache {path} has ")


def test_tokenize_files_concurrent_callers_tokenize_once(tokenizer: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    files = write_corpus(tmp_path / "corpus")
    calls = count_encode_calls(tokenizer, monkeypatch)
    results: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda: results.append(tokenize_files(files, tokenizer, tmp_path / "t", "c", errors="replace")))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and len(calls) == 33
    assert all(np.array_equal(r, results[0]) for r in results)


def test_default_tokenizer_trains_once_and_loads_cache(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(text, "stdlib_sources", lambda: SMALL_FILES)
    trained: list[list[Path]] = []

    def slow_train_bpe(files, vocab_size, out_dir):
        trained.append(list(files))
        time.sleep(0.3)  # let the other callers pile up on the lock
        return train_bpe(files, vocab_size, out_dir)

    monkeypatch.setattr(text, "train_bpe", slow_train_bpe)
    results: list[Tokenizer] = []
    threads = [threading.Thread(target=lambda: results.append(default_tokenizer(vocab_size=300))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(trained) == 1 and len(results) == 3
    assert set(trained[0]) == set(split_by_file(SMALL_FILES)[0])  # trained on the train split only
    out_dir = results[0].checkpoint_dir
    assert out_dir.parent == cache / "tokenizers" and out_dir.name.endswith("-bpe300")
    assert default_tokenizer(vocab_size=300).vocab_size == 300 and len(trained) == 1

    # a damaged file is trained again (the same files: the token caches keyed by them stay valid)
    files = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    (out_dir / "tokenizer.json").write_bytes(files["tokenizer.json"][:-100])
    capsys.readouterr()
    assert default_tokenizer(vocab_size=300).vocab_size == 300 and len(trained) == 2
    assert capsys.readouterr().err.startswith(f"warning: the cache {out_dir} has a file tokenizer.json that has ")
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == files


def sampler_steps(world_size: int, steps: int, **kwargs) -> list[list[list[int]]]:
    """steps x ranks: each rank's indices for each step."""
    out = [[] for _ in range(steps)]
    for rank in range(world_size):
        sampler = GlobalBatchSampler(rank=rank, world_size=world_size, **kwargs)
        iterator = iter(sampler)
        for step in range(steps):
            batches = [next(iterator) for _ in range(sampler.accumulation_steps)]
            assert all(len(b) == kwargs["micro_batch_size"] for b in batches)
            out[step].append([i for b in batches for i in b])
    return out


def test_global_batch_is_independent_of_world_size() -> None:
    kwargs = dict(dataset_len=13, global_batch_size=8, micro_batch_size=2, seed=3)
    single = [ranks[0] for ranks in sampler_steps(1, 7, **kwargs)]
    stream = [i for step in single for i in step]
    assert sorted(stream[:13]) == list(range(13)) and sorted(stream[13:26]) == list(range(13))  # epochs
    assert stream[:13] != stream[13:26]  # a new permutation each epoch
    for world_size in (2, 4):
        per_rank = sampler_steps(world_size, 7, **kwargs)
        for step, ranks in enumerate(per_rank):
            share = 8 // world_size
            for rank, indices in enumerate(ranks):
                assert indices == single[step][rank * share : (rank + 1) * share]  # contiguous share
            assert sorted(i for r in ranks for i in r) == sorted(single[step])
    assert sampler_steps(1, 2, **{**kwargs, "seed": 4})[0] != [single[0]]


def test_sampler_resumes_exactly() -> None:
    kwargs = dict(dataset_len=11, global_batch_size=8, micro_batch_size=2, rank=1, world_size=2, seed=0)
    uninterrupted = iter(GlobalBatchSampler(**kwargs))
    expected = [next(uninterrupted) for _ in range(2 * 10)]  # 2 micro batches per step on each rank

    sampler = GlobalBatchSampler(**kwargs)
    iterator = iter(sampler)
    assert sampler.state_dict() == {"step": 0}
    consumed = [next(iterator) for _ in range(2 * 4)]
    assert sampler.state_dict() == {"step": 4} and consumed == expected[:8]
    state = sampler.state_dict()
    resumed = GlobalBatchSampler(**kwargs)
    resumed.load_state_dict(state)
    assert [b for b, _ in zip(resumed, range(12))] == expected[8:]
    assert [b for b, _ in zip(GlobalBatchSampler(**kwargs, start_step=4), range(12))] == expected[8:]


def test_sampler_works_as_dataloader_batch_sampler() -> None:
    dataset = PackedDataset(np.arange(100), seq_length=4)
    sampler = GlobalBatchSampler(len(dataset), 6, 3, rank=0, world_size=1, seed=0)
    x, y = next(iter(DataLoader(dataset, batch_sampler=sampler)))
    assert x.shape == y.shape == (3, 4) and torch.equal(x[:, 1:], y[:, :-1])


def test_sampler_rejects_invalid_sizes() -> None:
    with pytest.raises(UsageError, match=r"global_batch_size=8.*devices \(2\).*micro_batch_size \(3\).*\[1, 2, 4\]"):
        GlobalBatchSampler(100, 8, 3, rank=0, world_size=2, seed=0)
    with pytest.raises(UsageError, match="multiple of 4"):
        GlobalBatchSampler(100, 6, 1, rank=0, world_size=4, seed=0)
    with pytest.raises(UsageError, match="rank"):
        GlobalBatchSampler(100, 8, 2, rank=2, world_size=2, seed=0)
    GlobalBatchSampler(3, 8, 2, rank=0, world_size=2, seed=0)  # fewer samples than a batch: wraps epochs


def test_load_pretrain_data_file_and_directory(tokenizer: Tokenizer, tmp_path: Path) -> None:
    files = write_corpus(tmp_path / "corpus", encoding="utf-8")
    (tmp_path / "corpus" / "ignored.dat").write_text("a,b\n" * 1000)
    (tmp_path / "corpus" / ".hidden").mkdir()
    (tmp_path / "corpus" / ".hidden" / "x.txt").write_text("hidden " * 1000)
    train, val, description = load_pretrain_data(tmp_path / "corpus", tokenizer, seq_length=16, val_fraction=0.3)
    assert len(train) > 0 and len(val) > 0 and "train" in description and "windows of 16 tokens" in description
    total = len(tokenize_files(files, tokenizer, text.cache_root() / "tokens", "all"))
    assert len(train.tokens) + len(val.tokens) <= total

    # One file: the last val_fraction of its tokens is val
    train, val, description = load_pretrain_data(files[0], tokenizer, seq_length=16, val_fraction=0.1)
    tokens = tokenize_files([files[0]], tokenizer, text.cache_root() / "tokens", "a")
    cut = len(tokens) - int(len(tokens) * 0.1)
    assert np.array_equal(train.tokens, tokens[:cut]) and np.array_equal(val.tokens, tokens[cut:])

    # Held-out part shorter than a window: val is the last train windows, said in the description
    n = len(tokens)
    train, val, description = load_pretrain_data(files[0], tokenizer, seq_length=n // 4, val_fraction=0.1)
    assert len(val) >= 1 and len(train) >= 1 and "last 1 window" in description


def test_load_pretrain_data_errors(tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist.*--data_path"):
        load_pretrain_data(tmp_path / "missing", tokenizer, seq_length=8)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "table.dat").write_text("a,b\n")
    with pytest.raises(UserError, match=r"no usable files.*\*\.txt.*\*\.jsonl.*\*\.parquet, \*\.csv"):
        load_pretrain_data(tmp_path / "empty", tokenizer, seq_length=8)
    (tmp_path / "short.txt").write_text("x = 1\n")
    with pytest.raises(UserError, match=r"has \d+ tokens, fewer than one window of seq_length \+ 1 = 4097.*"
                                        r"--override_max_seq_length"):
        load_pretrain_data(tmp_path / "short.txt", tokenizer, seq_length=4096)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(UserError, match='line 2 of .*bad.jsonl has no "text"'):
        load_pretrain_data(tmp_path / "bad.jsonl", tokenizer, seq_length=8)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(UserError, match="Line 2 of .*broken.jsonl is not valid JSON"):
        load_pretrain_data(tmp_path / "broken.jsonl", tokenizer, seq_length=8)
    with pytest.raises(UsageError, match="val_fraction"):
        load_pretrain_data(tmp_path / "short.txt", tokenizer, seq_length=8, val_fraction=0)


def test_unigram_loss() -> None:
    train, val = np.array([0, 0, 1, 2], dtype=np.uint16), np.array([0, 3])
    # add-one: p(0) = 3/8, p(3) = 1/8
    assert unigram_loss(train, val, vocab_size=4) == pytest.approx(-(math.log(3 / 8) + math.log(1 / 8)) / 2)
    rng = np.random.default_rng(0)
    skewed = rng.zipf(1.5, size=20_000) % 300
    loss = unigram_loss(skewed[:15_000], torch.from_numpy(skewed[15_000:]), vocab_size=300)
    assert math.isfinite(loss) and loss < math.log(300)
    with pytest.raises(UsageError, match="vocab_size"):
        unigram_loss(np.array([5]), np.array([1]), vocab_size=4)


def test_unigram_loss_counts_a_corpus_in_bounded_memory() -> None:
    # it runs at the end of pretraining, on top of the run's peak: bincount's int64 copy of the tokens is made a chunk
    # at a time (8 MiB), never of the whole corpus (a 16M-token chunk copied the default 8.9M-token corpus whole: 71 MB)
    import tracemalloc

    tokens = np.arange(6_000_000, dtype=np.uint16) % 8192
    tracemalloc.start()
    try:
        unigram_loss(tokens, tokens[:1000], vocab_size=8192)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20, peak


@pytest.mark.slow
def test_default_tokenizer_and_full_stdlib_end_to_end(cache: Path) -> None:
    start = time.perf_counter()
    tokenizer = default_tokenizer()
    trained = time.perf_counter()
    train, val, description = load_pretrain_data(None, tokenizer, seq_length=512)
    tokenized = time.perf_counter()
    assert tokenizer.vocab_size == 8192 and len(train) > 10_000 and len(val) > 100
    default_tokenizer(), load_pretrain_data(None, tokenizer, seq_length=512)
    cached = time.perf_counter()
    loss = unigram_loss(train.tokens, val.tokens, tokenizer.vocab_size)
    assert loss < math.log(tokenizer.vocab_size)
    print(f"\n{description}\ndefault_tokenizer: {trained - start:.1f} s, tokenizing the stdlib: "
          f"{tokenized - trained:.1f} s, both again from the cache: {cached - tokenized:.2f} s, "
          f"unigram val loss {loss:.3f} nats (log V = {math.log(tokenizer.vocab_size):.3f})")
