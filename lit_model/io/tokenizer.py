"""Text <-> token ids for a checkpoint: Hugging Face ``tokenizers`` (tokenizer.json) or SentencePiece
(tokenizer.model), plus ``train_bpe`` to make a byte-level BPE tokenizer for pretraining from scratch.

Special tokens are read from tokenizer_config.json and generation_config.json, the files transformers
reads, so ``encode`` gives the ids the checkpoint was trained on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from lit_model.core.errors import UsageError, UserError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
    "chat_template.jinja",
)


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds a tokenizer's model (what ``Tokenizer`` reads)."""
    return any((Path(directory) / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))


class Tokenizer:
    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        if not self.checkpoint_dir.is_dir():
            state = "is a file, not a directory" if self.checkpoint_dir.exists() else "does not exist"
            raise UserError(
                f"Tokenizer directory {self.checkpoint_dir} {state}. Pass the directory that holds tokenizer.json "
                "or tokenizer.model (a checkpoint directory)."
            )
        config = _read_json(self.checkpoint_dir / "tokenizer_config.json")
        generation = _read_json(self.checkpoint_dir / "generation_config.json")
        native_bos = native_eos = None
        if (path := self.checkpoint_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self.backend = "huggingface"
            self.processor: Any = _parse(path, HFTokenizer.from_file)
            self.vocab_size: int = self.processor.get_vocab_size(with_added_tokens=True)
        elif (path := self.checkpoint_dir / "tokenizer.model").is_file():
            from sentencepiece import SentencePieceProcessor

            self.backend = "sentencepiece"
            self.processor = _parse(path, lambda file: SentencePieceProcessor(model_file=file))
            self.vocab_size = self.processor.vocab_size()
            # SentencePiece reports -1 for a special token the model was trained without
            native_bos, native_eos = (i if i >= 0 else None for i in (self.processor.bos_id(), self.processor.eos_id()))
        else:
            names = sorted(p.name for p in self.checkpoint_dir.iterdir())
            present = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "") or "nothing"
            raise UserError(
                f"No tokenizer in {self.checkpoint_dir}: expected tokenizer.json or tokenizer.model, found {present}. "
                "Download the tokenizer files together with the checkpoint, or train one with train_bpe."
            )

        # generation_config.json's ids are what transformers generates with, so they win over the token names
        gen_bos, gen_eos = generation.get("bos_token_id"), generation.get("eos_token_id")
        gen_eos_ids = [i for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if isinstance(i, int)]
        config_bos, config_eos = (self._config_token_id(config, key) for key in ("bos_token", "eos_token"))
        bos_ids = (gen_bos if isinstance(gen_bos, int) else None, config_bos, native_bos)
        self.bos_id: int | None = next((i for i in bos_ids if i is not None), None)
        self.eos_id: int | None = next((i for i in (*gen_eos_ids[:1], config_eos, native_eos) if i is not None), None)
        # Stop generating on any of them: chat models end turns with a token other than the tokenizer's eos
        stop_ids = (*gen_eos_ids, self.eos_id, config_eos)
        self.eos_ids: list[int] = list(dict.fromkeys(i for i in stop_ids if i is not None))

        if "add_bos_token" in config:
            self.use_bos = bool(config["add_bos_token"])
        elif self.backend == "huggingface":
            # transformers 5 (and Llama 3) record "add bos" only as a post-processor in tokenizer.json
            self.use_bos = self.bos_id is not None and self.processor.encode("").ids[:1] == [self.bos_id]
        else:
            # SentencePiece checkpoints (Llama 2, Mistral, ...) were trained with bos at the start of every text
            self.use_bos = self.bos_id is not None

    def _config_token_id(self, config: dict[str, Any], key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # transformers' AddedToken form: {"content": "<s>", "lstrip": false, ...}
            token = token.get("content")
        return self.token_to_id(token) if isinstance(token, str) else None

    def token_to_id(self, token: str) -> int:
        if self.backend == "huggingface":
            id_ = self.processor.token_to_id(token)
        else:
            id_ = self.processor.piece_to_id(token)
            if id_ == self.processor.unk_id() and token != self.processor.id_to_piece(id_):
                id_ = None  # SentencePiece maps unknown pieces to unk instead of failing
        if id_ is None:
            raise UserError(
                f"Token {token!r} is not in the vocabulary of the tokenizer in {self.checkpoint_dir}. Check the "
                "spelling against tokenizer_config.json, or use the tokenizer that belongs to this checkpoint."
            )
        return id_

    def encode(self, text: str, bos: bool | None = None, eos: bool = False, max_length: int = -1) -> torch.Tensor:
        try:
            if self.backend == "huggingface":
                # bos/eos are added below from the checkpoint's configuration, the same way for both backends
                ids = self.processor.encode(text, add_special_tokens=False).ids
            else:
                ids = self.processor.encode(text)
        except (TypeError, UnicodeError, RuntimeError):  # what the backends raise for lone surrogates, among others
            check_utf8(text, "The text to encode")
            raise
        if self.use_bos if bos is None else bos:
            if self.bos_id is None:
                raise UsageError(f"The tokenizer in {self.checkpoint_dir} has no bos token; encode with bos=False.")
            if ids[:1] != [self.bos_id]:  # a prompt template may already start with the bos text
                ids = [self.bos_id, *ids]
        if eos:
            if self.eos_id is None:
                raise UsageError(f"The tokenizer in {self.checkpoint_dir} has no eos token; encode with eos=False.")
            if ids[-1:] != [self.eos_id]:
                ids = [*ids, self.eos_id]
        if max_length > 0:
            ids = ids[:max_length]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        return self.processor.decode(ids)

    def save(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if out_dir.resolve() == self.checkpoint_dir.resolve():
            return
        for name in TOKENIZER_FILES:
            if (src := self.checkpoint_dir / name).is_file():
                shutil.copy2(src, out_dir / name)


def check_utf8(text: str, what: str) -> None:
    """Refuse text that holds lone surrogates: Python's stand-ins for bytes that were not UTF-8 in the command
    line (and, in UTF-8 mode, standard input). No tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise UsageError(
            f"{what} is not UTF-8 text ({byte} at character {error.start}). Pass UTF-8: use a UTF-8 terminal "
            "locale (e.g. LANG=C.UTF-8), or convert the text first (e.g. with `iconv -t utf-8`)."
        ) from None


def train_bpe(
    files: Iterable[str | Path],
    vocab_size: int,
    out_dir: str | Path,
    special_tokens: Sequence[str] = ("<|endoftext|>",),
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style, so any text round-trips exactly) on UTF-8 text files.

    The first special token is both bos and eos; ``encode`` does not add bos unless asked.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    files = [Path(f) for f in files]
    if not files or (missing := [str(f) for f in files if not f.is_file()]):
        listed = ", ".join(missing) if files else "none given"
        raise UsageError(f"train_bpe needs existing text files to train on (missing: {listed}). Pass their paths.")
    if not special_tokens:
        raise UsageError('train_bpe needs at least one special token to use as bos/eos, e.g. "<|endoftext|>".')
    if vocab_size < 256 + len(special_tokens):
        raise UsageError(
            f"vocab_size={vocab_size} is too small: byte-level BPE needs 256 byte tokens plus "
            f"{len(special_tokens)} special token(s). Pass vocab_size of at least {256 + len(special_tokens)}."
        )

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token: no unknown input
        show_progress=True,
    )
    try:
        tokenizer.train([str(f) for f in files], trainer)
    except Exception as error:  # `tokenizers` raises bare Exceptions, e.g. for a file that is not UTF-8
        raise UserError(
            f"Training the tokenizer failed: {error}. train_bpe reads UTF-8 text files; convert or drop the "
            f"others among: {', '.join(map(str, files))}."
        ) from error

    # Write into a temporary directory next to out_dir and move the files in at the end, so an interrupted
    # run never leaves a tokenizer.json without its configs (or half of one)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; when renamed it becomes out_dir
        tokenizer.save(str(tmp / "tokenizer.json"))
        special, special_id = special_tokens[0], tokenizer.token_to_id(special_tokens[0])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special, "eos_token": special}
        _write_json(tmp / "tokenizer_config.json", {**config, "add_bos_token": False})
        _write_json(tmp / "generation_config.json", {"bos_token_id": special_id, "eos_token_id": special_id})
        if out_dir.exists():
            for path in tmp.iterdir():
                os.replace(path, out_dir / path.name)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Tokenizer(out_dir)


def _parse(path: Path, parser: Callable[[str], Any]) -> Any:
    try:
        return parser(str(path))
    except Exception as error:  # the parsers raise bare Exception/RuntimeError with the useful detail
        raise UserError(
            f"Could not read the tokenizer file {path}: {error}. It is corrupt or incomplete; download it "
            "again from the checkpoint's source."
        ) from error


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise UserError(f"Could not read {path}: {error}. Fix the JSON or download the file again.") from error
    if not isinstance(data, dict):
        raise UserError(f"{path} should hold a JSON object, not {type(data).__name__}. Download the file again.")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


class ByteCountTokenizer:
    """Stands in for the tokenizer of a checkpoint that is not there yet (a --plan of a model not downloaded), to
    count a data's lengths: one token per UTF-8 byte, plus bos, a SentencePiece word-start piece and eos. Every piece a
    byte-level BPE or SentencePiece tokenizer makes covers at least one byte (byte fallback: exactly one), so no
    checkpoint's tokenizer makes more tokens of the same text: the lengths it gives are upper bounds."""

    bos_id, eos_id, use_bos = 1, 2, True
    eos_ids = (2,)

    def encode(self, text: str, bos: bool | None = None, eos: bool = False, max_length: int = -1) -> torch.Tensor:
        count = len(text.encode("utf-8", "surrogatepass")) + 1 + (self.use_bos if bos is None else bool(bos)) + eos
        return torch.zeros(count if max_length < 0 else min(count, max_length), dtype=torch.long)
