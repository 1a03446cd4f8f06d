"""Download a model from the Hugging Face Hub and convert it to a lit-model checkpoint in one step.

    python -m lit_model.download ORG/NAME [--access_token T] [--checkpoint_dir DIR] [--dtype bfloat16]

Only the files the conversion reads are fetched: config.json, the tokenizer files and the weights (the
safetensors shards, or the ``.bin`` shards of a repository without safetensors). ``huggingface_hub`` does the
transfer, so its cache (``HF_HOME`` / ``HF_HUB_CACHE``), resumption of interrupted downloads, progress bars,
``HF_TOKEN`` and offline mode (``HF_HUB_OFFLINE=1``: only what the cache holds) all apply. The checkpoint is
written to ``checkpoints/ORG/NAME`` unless ``--checkpoint_dir`` says otherwise, where ``--model_name ORG/NAME`` of
the finetune and generate scripts finds it (``resolve_checkpoint``).
"""

from __future__ import annotations

import contextlib
import difflib
import http
import importlib
import io
import json
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional


from lit_model.io.checkpoint import CONFIG_NAME, check_checkpoint_dir
from lit_model.core.config import Config, known_names
from lit_model.core.files import check_out_dir_path
from lit_model.io.convert import (
    BIN_INDEX, BIN_SINGLE, SAFE_INDEX, SAFE_SINGLE, SUPPORTED_TYPES, _inside, config_from_hf, hf_to_lit,
)
from lit_model.core.errors import UsageError, UserError
from lit_model.io.tokenizer import TOKENIZER_FILES

CONFIG_FILE = "config.json"
# What hf_to_lit reads, safetensors first; a repository's other weight formats (consolidated.safetensors,
# original/*.pth, ONNX, GGUF) are never fetched.
SAFETENSORS_PATTERNS = (SAFE_INDEX, SAFE_SINGLE, "model-*-of-*.safetensors")
BIN_PATTERNS = (BIN_INDEX, BIN_SINGLE, "pytorch_model-*-of-*.bin")
DEFAULT_ROOT = Path("checkpoints")
# One part of a repository id, as the Hub allows it: letters, digits, "_", "-" and "." (not at either end)
REPO_ID_PART = re.compile(r"\w(?:[\w.-]{0,94}\w)?", re.ASCII)


def download(
    repo_id: str,
    access_token: Optional[str] = None,
    checkpoint_dir: Optional[Path] = None,
    overwrite: bool = False,
    dtype: Optional[str] = None,
) -> Path:
    """Download a Hugging Face model (weights, config, tokenizer) and convert it to a lit-model checkpoint.

    Args:
        repo_id: the model's repository on the Hub, ORG/NAME (e.g. Qwen/Qwen2.5-0.5B-Instruct)
        access_token: Hugging Face token for gated or private models (default: HF_TOKEN or `hf auth login`'s)
        checkpoint_dir: where to write the lit-model checkpoint (default: checkpoints/ORG/NAME)
        overwrite: replace checkpoint_dir if it already holds files
        dtype: store the weights in this dtype (e.g. bfloat16); default: as published
    """
    org, name = _split_repo_id(repo_id)
    out_dir = Path(checkpoint_dir) if checkpoint_dir is not None else DEFAULT_ROOT / org / name
    # before gigabytes are fetched that could not be saved
    check_out_dir_path(out_dir, replaced=True, flag="--checkpoint_dir")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(
            f"{out_dir} already holds files (a checkpoint of {repo_id}?). Use it as --checkpoint_dir {out_dir}, "
            "or pass --overwrite to download and convert again."
        )
    token = access_token or None  # None: huggingface_hub reads HF_TOKEN or the saved login itself
    _from_hub(repo_id, token, lambda hub: _check_listing(hub, repo_id, token))
    config_file = Path(_from_hub(repo_id, token, lambda hub: hub.hf_hub_download(repo_id, CONFIG_FILE, token=token)))
    _check_model_type(repo_id, config_file)
    metadata = (CONFIG_FILE, *TOKENIZER_FILES)
    snapshot = Path(_from_hub(repo_id, token, lambda hub: hub.snapshot_download(
        repo_id, allow_patterns=[*metadata, *SAFETENSORS_PATTERNS], token=token)))
    if not _has_weights(snapshot, SAFETENSORS_PATTERNS):  # an older repository: PyTorch pickles only
        snapshot = Path(_from_hub(repo_id, token, lambda hub: hub.snapshot_download(
            repo_id, allow_patterns=[*metadata, *BIN_PATTERNS], token=token)))
        if not _has_weights(snapshot, BIN_PATTERNS):
            raise UserError(
                f"{repo_id} holds no weights in a layout lit-model converts ({', '.join(SAFETENSORS_PATTERNS)}, or "
                f"{', '.join(BIN_PATTERNS)}); GGUF, ONNX and other exports are not read. Choose the repository of "
                "the original transformers checkpoint."
            )
    # The cache names a snapshot by its commit; conversion names the model after its directory, and its own
    # report would name this temporary one.
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        named = Path(tmp) / name
        named.mkdir()
        for path in snapshot.iterdir():
            (named / path.name).symlink_to(path.resolve())
        hf_to_lit(str(named), str(out_dir), overwrite=overwrite, dtype=dtype)
    model = f"--model_name {repo_id}" if out_dir == DEFAULT_ROOT / org / name else f"--checkpoint_dir {out_dir}"
    print(f"Saved a lit-model checkpoint of {repo_id} to {out_dir} (the downloaded files stay in {snapshot}).\n"
          f"Next: lit-model chat {model}, or lit-model finetune lora {model} --data_path DATA")
    return out_dir


def resolve_checkpoint(
    model_name: Optional[str], checkpoint_dir: Path, default_dir: Path, plan: bool, model_config: Optional[Path] = None,
) -> tuple[Optional[Path], Config]:
    """The checkpoint directory a finetune or generate run reads, and its config: ``--checkpoint_dir``, or for
    ``--model_name ORG/NAME`` (or a registry name, published as ORG/NAME) what ``lit-model download ORG/NAME``
    wrote to checkpoints/ORG/NAME. Without ``plan`` the checkpoint is verified (tokenizer included). With
    ``plan`` only its config is read, and a model not downloaded yet is planned from the registry, or from
    ``--model_config`` (a YAML of Config fields: a custom architecture); the directory is then None."""
    directory: Optional[Path] = Path(checkpoint_dir)
    if model_config is not None:
        if not plan:
            raise UsageError(
                f"--model_config {model_config} describes an architecture to plan (with --plan); a run reads the "
                "architecture from its checkpoint's model_config.yaml. Drop --model_config, or add --plan text."
            )
        if model_name is not None or directory != default_dir:
            named = f"--model_name {model_name}" if model_name is not None else f"--checkpoint_dir {checkpoint_dir}"
            raise UsageError(f"--model_config {model_config} and {named} both name the model to plan; pass one of them.")
        return None, Config.from_file(model_config)
    if model_name is not None:
        if directory != default_dir:
            raise UsageError(
                f"--model_name {model_name} and --checkpoint_dir {checkpoint_dir} both name the model to start from; "
                "pass one of them (--model_name ORG/NAME reads checkpoints/ORG/NAME, where `lit-model download "
                "ORG/NAME` writes it; --checkpoint_dir reads a checkpoint anywhere else)."
            )
        directory = _downloaded(model_name, plan)
        if directory is None:
            return None, _registry_config(model_name)
    if plan:
        if not (directory / CONFIG_NAME).is_file():
            raise UsageError(
                f"--plan needs the model's architecture, but {directory} has no {CONFIG_NAME}. Pass --model_name "
                "(`lit-model config` lists the known names) to plan before the weights are there."
            )
        return directory, Config.from_checkpoint(directory)
    if model_name is None and directory == default_dir and not directory.is_dir():
        raise UserError(
            f"No --checkpoint_dir given and the default {default_dir} does not exist yet. Make it with "
            "`python pretrain/main.py` (a few minutes on a CPU), download a model with `lit-model download ORG/NAME` "
            "and pass --model_name ORG/NAME, or pass --checkpoint_dir with a checkpoint."
        )
    directory = check_checkpoint_dir(directory, need_tokenizer=True)
    return directory, Config.from_checkpoint(directory)


def _downloaded(model_name: str, plan: bool) -> Optional[Path]:
    """checkpoints/ORG/NAME for a repository id or a published registry name; None when it is not there and
    ``plan`` (the registry then has the architecture), a message naming the download when it is needed."""
    if "/" in model_name:
        org, name = _split_repo_id(model_name)
    else:
        config = Config.from_name(model_name)
        if not config.hf_org:
            if plan:
                return None
            raise UsageError(
                f"--model_name {model_name} is an architecture with no published weights to download (it plans with "
                "--plan). Pass --checkpoint_dir with a checkpoint of it, e.g. out/pretrain/final."
            )
        org, name = config.hf_org, config.name
    directory = DEFAULT_ROOT / org / name
    if directory.is_dir() or plan:
        return directory if directory.is_dir() else None
    raise UserError(
        f"--model_name {model_name}: {org}/{name} is not downloaded ({directory} does not exist). Download it with "
        f"`lit-model download {org}/{name}` (run here, it writes {directory}), or pass --checkpoint_dir with a "
        "checkpoint elsewhere instead of --model_name."
    )


def _registry_config(model_name: str) -> Config:
    """The architecture to plan a model not downloaded yet; a repository the registry does not know is refused
    with the download that would give its config."""
    try:
        return Config.from_name(model_name)
    except UsageError:
        if "/" not in model_name:
            raise
        raise UsageError(
            f"--model_name {model_name} is neither downloaded ({DEFAULT_ROOT / model_name} does not exist) nor in "
            f"the config registry, so there is no architecture to plan from.{_close_repo_ids(model_name)} Download "
            f"it with `lit-model download {model_name}` and plan again (its config is then read), or pass "
            "--checkpoint_dir with a checkpoint of it."
        ) from None


def _split_repo_id(repo_id: str) -> tuple[str, str]:
    parts = repo_id.strip("/").split("/")
    if len(parts) == 2 and all(parts):
        # the parts name directories under checkpoints/ too, so ".." or a space would write elsewhere
        if all(REPO_ID_PART.fullmatch(p) and ".." not in p and "--" not in p for p in parts):
            return parts[0], parts[1]
        raise UsageError(
            f"{repo_id!r} is not a valid Hugging Face repository id: ORG and NAME hold only letters, digits, '_', '-' "
            "and '.' (not at either end, no '..' or '--'), e.g. Qwen/Qwen2.5-0.5B."
        )
    known = [Config.from_name(n).hf_name for n in known_names() if n == parts[-1]]
    hint = f" The registry knows {parts[-1]!r} as {known[0]}." if known and "/" in known[0] else ""
    raise UsageError(f"{repo_id!r} is not a Hugging Face repository id: give ORG/NAME, e.g. Qwen/Qwen2.5-0.5B.{hint}")


def hub_repo_ids() -> list[str]:
    """The repository ids of every published model in the config registry."""
    return sorted({config.hf_name for config in map(Config.from_name, known_names()) if config.hf_org})


def _close_repo_ids(repo_id: str) -> str:
    ids = hub_repo_ids()
    by_lower = {i.lower(): i for i in ids}
    close = [by_lower[i] for i in difflib.get_close_matches(repo_id.lower(), list(by_lower), n=3, cutoff=0.6)]
    return f" Did you mean {', '.join(close)}?" if close else ""


def _check_model_type(repo_id: str, config_file: Path) -> None:
    """Refuse before the weights are fetched when conversion could not read them."""
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
        model_type = hf_config.get("model_type")
    except (OSError, ValueError, AttributeError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UserError(f"{repo_id}'s config.json could not be read ({error}). Check the repository.") from None
    except RecursionError:
        raise UserError(f"{repo_id}'s config.json nests too deeply to be a model's config. Check the repository.") from None
    if model_type not in SUPPORTED_TYPES:
        raise UserError(
            f"{repo_id} is a {model_type!r} model; lit-model converts the model types {', '.join(SUPPORTED_TYPES)}. "
            "Choose a model of one of these families (`python -m lit_model.config` lists the known ones)."
        )
    config_from_hf(hf_config)  # every value's type and size, before gigabytes of weights are fetched for nothing


def _check_listing(hub: Any, repo_id: str, token: Optional[str]) -> None:
    """Refuse a repository that names a file outside its own directory (``../x``: written outside the cache)
    before anything is fetched. Listing it first also reports a Hub that answers with an error (HTTP 5xx) or stops
    answering as such, where snapshot_download would fall back to the cache and report missing weights. A Hub that
    cannot be reached at all is left to the calls after this one: they retry, then take what the cache holds."""
    if hub.constants.is_offline_mode():
        return
    http_library = _http_library(hub)
    try:
        info = hub.HfApi().model_info(repo_id, revision="main", token=token)
    except (http_library.ConnectError, http_library.ConnectTimeout):
        return
    outside = [sibling.rfilename for sibling in info.siblings or [] if not _inside(sibling.rfilename)]
    if outside:
        raise UserError(
            f"{repo_id} lists a file named {outside[0]!r}, which would be written outside the download cache; nothing "
            "was fetched. The Hub (or the server HF_ENDPOINT names) is not to be trusted: check HF_ENDPOINT."
        )


def _http_library(hub: Any) -> Any:
    """The HTTP client library huggingface_hub uses (httpx, or its fork httpx2), for its error classes."""
    return importlib.import_module(type(hub.get_session()).__module__.split(".")[0])


def _bound_timeouts(request: Any) -> None:
    """An httpx request hook: huggingface_hub gives some requests no timeout at all (the repository listing), so a
    server that accepts the connection and never answers would hold the download forever. Every wait of every
    request is bounded by HF_HUB_DOWNLOAD_TIMEOUT (10 s unless set), as huggingface_hub bounds its file reads."""
    from huggingface_hub import constants

    timeout = request.extensions.get("timeout") or {}
    seconds = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    request.extensions["timeout"] = {key: timeout.get(key) or seconds for key in ("connect", "read", "write", "pool")}


def _http_status(error: BaseException) -> Optional[int]:
    """The HTTP status behind a huggingface_hub error (LocalEntryNotFoundError hides it in its cause), or None."""
    while error is not None:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
        error = error.__cause__ or error.__context__
    return None


def _status_text(status: int) -> str:
    try:
        return f"HTTP {status} ({http.HTTPStatus(status).phrase})"
    except ValueError:
        return f"HTTP {status}"


def _has_weights(snapshot: Path, patterns: tuple[str, ...]) -> bool:
    return any(any(snapshot.glob(pattern)) for pattern in patterns)


def _from_hub(repo_id: str, token: Optional[str], call: Callable[[Any], Any]) -> Any:
    """Run ``call(huggingface_hub)`` with the hub's errors turned into messages that name the fix."""
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors
    except ImportError:
        raise UserError(
            "Downloading needs the huggingface_hub package (a dependency of lit-model): `pip install "
            "huggingface_hub`, or download the files yourself and convert them with `python -m lit_model.convert "
            "hf_to_lit --hf_dir DIR --out_dir DIR`."
        ) from None
    token_hint = (
        "The token passed does not grant access: check it, and accept the model's license on its page."
        if token else "Pass --access_token (or set HF_TOKEN) with a token of an account that has access."
    )
    local_copy = (
        "To use a copy you have elsewhere, convert it with `python -m lit_model.convert hf_to_lit --hf_dir DIR "
        "--out_dir DIR`."
    )
    session = hub.get_session()  # the process's shared client: the hook stays for its later downloads
    if _bound_timeouts not in session.event_hooks["request"]:
        session.event_hooks = {**session.event_hooks, "request": [*session.event_hooks["request"], _bound_timeouts]}
    transport_error = _http_library(hub).TransportError
    retry = "Run this again later: finished files are kept and unfinished ones resume."
    try:
        return call(hub)
    except errors.GatedRepoError:
        raise UserError(
            f"{repo_id} is a gated model: its files need a Hugging Face account that accepted its license at "
            f"https://huggingface.co/{repo_id}. {token_hint}"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UserError(
            f"There is no model {repo_id!r} on the Hugging Face Hub, or it is private.{_close_repo_ids(repo_id)} "
            f"Check the spelling; for a private model, {token_hint[0].lower()}{token_hint[1:]}"
        ) from None
    except errors.RemoteEntryNotFoundError:
        raise UserError(
            f"{repo_id} has no config.json, so it is not a transformers model lit-model can convert. Choose a "
            "repository that holds config.json and safetensors or .bin weights."
        ) from None
    except errors.LocalEntryNotFoundError as error:
        status = _http_status(error)
        if hub.constants.is_offline_mode():
            reason = "HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it; unset HF_HUB_OFFLINE to download"
        elif status is not None:  # the Hub answered, with an error of its own: not the network
            reason = (f"the Hugging Face Hub answered {_status_text(status)}, a failure on the Hub's side (or of the "
                      "server HF_ENDPOINT names), and the cache does not hold it")
        else:
            reason = ("the Hugging Face Hub could not be reached (no network?) and the cache does not hold it; check "
                      "the connection (or HF_ENDPOINT)")
        raise UserError(f"Could not get {repo_id}: {reason}. {retry} {local_copy}") from None
    except errors.HfHubHTTPError as error:
        status = _http_status(error)
        if status in (401, 403):
            raise UserError(f"The Hugging Face Hub refused access to {repo_id} (HTTP {status}). {token_hint}") from None
        failure = _status_text(status) if status is not None else _first_line(error)
        raise UserError(f"Downloading {repo_id} failed: the Hugging Face Hub answered {failure}. {retry} {local_copy}"
                        ) from None
    except ValueError as error:  # huggingface_hub's checks of what the Hub sent (a file name with "..")
        raise UserError(f"Downloading {repo_id} failed: {_first_line(error)}. Nothing was written outside the "
                        "Hugging Face cache. Check HF_ENDPOINT, or report it to the repository's owner.") from None
    except transport_error as error:  # the connection broke off, or the server stopped answering
        raise UserError(
            f"Downloading {repo_id} failed: the connection to the Hugging Face Hub broke off or stopped answering "
            f"({type(error).__name__}: {_first_line(error)}). {retry} {local_copy}"
        ) from None
    except OSError as error:  # a full disk, an unwritable cache directory
        raise UserError(
            f"Downloading {repo_id} failed: {error}. Free disk space or point HF_HUB_CACHE at a writable directory "
            f"(now {hub.constants.HF_HUB_CACHE})."
        ) from None


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
