"""``--logger``: where a training run's metrics rows go besides ``out_dir/metrics.csv``.

``metrics.csv`` (loop.MetricsWriter) is written by every run, whatever ``--logger`` says: ``csv`` names it. The other
backends are Lightning's loggers, started on rank 0 only, under ``out_dir/logs/``: each receives the run's flags once
and then every row metrics.csv gets, at the same step, and is finalized when the fit loop ends (``failed`` when it
ends in an error).

- ``tensorboard``: event files in ``out_dir/logs/tensorboard`` (``tensorboard --logdir out_dir/logs``). A resumed run
  writes into the same directory and hides the steps after its checkpoint, as metrics.csv drops those rows (a
  fresh run with --overwrite hides all the earlier ones).
- ``wandb``: a W&B run named after out_dir in project ``$WANDB_PROJECT`` (default lit-model), saved under
  ``out_dir/logs/wandb``. Offline (``wandb sync`` uploads it later) when ``WANDB_MODE=offline`` or when there is no
  API key (neither ``WANDB_API_KEY`` nor a ``wandb login`` entry in ~/.netrc).
- ``mlflow``: an MLflow run named after out_dir in experiment ``$MLFLOW_EXPERIMENT_NAME`` (default lit-model), at
  ``$MLFLOW_TRACKING_URI`` when set, else in a file store in ``out_dir/logs/mlflow`` (``mlflow ui
  --backend-store-uri out_dir/logs/mlflow`` with ``MLFLOW_ALLOW_FILE_STORE=true``, from the full mlflow package).

A resumed run is a new W&B or MLflow run that starts at the resumed step.

A logger's server never holds a run up: before anything starts, each server a logger would talk to (an http(s)
``MLFLOW_TRACKING_URI``; W&B's ``WANDB_BASE_URL`` when online) must answer within ``PROBE_TIMEOUT_S``, or the run
stops with one paragraph (``check_logger_servers``): a run asked to track somewhere should not train for hours
untracked. MLflow's HTTP client gets bounded retries (``MLFLOW_HTTP_BOUNDS``), so a server that goes away
mid-run costs a few seconds, after which that logger is dropped with a warning (metrics.csv keeps every row).
The loggers open before the fit loop defers stop signals, so a stop during their start ends the run at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import netrc
import os
import sys
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterator, Union
from urllib.parse import urlsplit

from lit_model.core.errors import UsageError, UserError

PROJECT = "lit-model"
# --logger name -> (the module it imports, what pip installs); csv needs nothing
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
LOGGERS = ("csv", *PACKAGES)
PROBE_TIMEOUT_S = 3.0  # how long a logger's server may take to answer before the run starts
# MLflow's own HTTP defaults (7 retries with exponential backoff, 120 s a request) keep a run silent for minutes when
# its server is gone, with stops deferred: at most ~7 s with these (a variable the user set wins)
MLFLOW_HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                      "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def logger_names(value: Union[str, list[str]]) -> list[str]:
    """``csv,tensorboard`` (the command line) or ``[csv, tensorboard]`` (YAML) as a list of names."""
    names = value.split(",") if isinstance(value, str) else value
    return [name.strip() for name in names]


def check_loggers(value: Union[str, list[str]]) -> None:
    """Every name is a logger and its package is installed, before anything starts."""
    names = logger_names(value)
    unknown = [name for name in names if name not in LOGGERS]
    if unknown or not names:
        raise UsageError(f"--logger {value!r}: {', '.join(map(repr, unknown)) or 'no name'} is not a logger. Choose from "
                         f"{', '.join(LOGGERS)}; several are joined by commas, e.g. --logger csv,tensorboard.")
    for name in names:
        module, package = PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise UsageError(f"--logger {name} needs the {package} package: run `pip install {package}` (or "
                             f"`pip install -e .[loggers]`), or drop {name} from --logger.")


def logger_servers(value: Union[str, list[str]]) -> dict[str, str]:
    """``--logger`` name -> the URL of the server it would talk to, for those that talk to one."""
    names, servers = logger_names(value), {}
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in names and urlsplit(tracking_uri).scheme in ("http", "https"):
        servers["mlflow"] = tracking_uri
    if "wandb" in names and not wandb_offline():
        servers["wandb"] = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return servers


def check_logger_servers(value: Union[str, list[str]]) -> None:
    """Each logger's server answers (any HTTP answer will do) within PROBE_TIMEOUT_S; else one paragraph, before
    anything starts. We stop rather than drop the logger: the run was asked to be tracked there."""
    for name, url in logger_servers(value).items():
        try:
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):
                pass
        except urllib.error.HTTPError:
            continue  # it answered: the server is there
        except (OSError, ValueError) as error:  # URLError, a timeout, a refused connection, a malformed URL
            reason = getattr(error, "reason", None) or error
            variable = "MLFLOW_TRACKING_URI" if name == "mlflow" else "WANDB_BASE_URL"
            fix = ("unset it (a file store in out_dir/logs/mlflow)" if name == "mlflow" else
                   "set WANDB_MODE=offline (wandb sync uploads the run later)")
            raise UserError(f"--logger {name}: {variable}={url} does not answer ({reason}; waited at most "
                            f"{PROBE_TIMEOUT_S:g} s). Start that server or point {variable} at one that runs, {fix}, "
                            f"or drop {name} from --logger (metrics.csv is written either way).") from None


def wandb_offline() -> bool:
    """Offline when asked to, or when W&B has no API key to go online with (it would prompt for one)."""
    mode = os.environ.get("WANDB_MODE")
    if mode in ("offline", "online"):
        return mode == "offline"
    if os.environ.get("WANDB_API_KEY"):
        return False
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is None
    except (OSError, netrc.NetrcParseError):
        return True


def start_logger(name: str, logs: Path, run_name: str, resume_step: int) -> Any:
    """Lightning's logger for ``name``, writing under ``logs``."""
    if name == "tensorboard":
        from lightning.fabric.loggers import TensorBoardLogger

        # TensorBoard hides the events that earlier runs wrote here from purge_step on: a fresh (--overwrite) run
        # hides them all, a resumed one those after its checkpoint
        return TensorBoardLogger(logs, name="tensorboard", version="", default_hp_metric=False,
                                 purge_step=resume_step + 1)
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(name=run_name, save_dir=logs, offline=wandb_offline(),
                           project=os.environ.get("WANDB_PROJECT", PROJECT))
    from lightning.pytorch.loggers import MLFlowLogger

    for variable, value in MLFLOW_HTTP_BOUNDS.items():
        os.environ.setdefault(variable, value)
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        tracking_uri = (logs / "mlflow").resolve().as_uri()
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses a file store unless told it is wanted
    return MLFlowLogger(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT), run_name=run_name,
                        tracking_uri=tracking_uri)


def finalize(name: str, logger: Any, status: str) -> None:
    logger.finalize(status)
    if name == "wandb":  # Lightning leaves ending the W&B run to the end of the process
        import wandb

        wandb.finish(exit_code=0 if status == "success" else 1)


@contextlib.contextmanager
def open_loggers(args: Any, enabled: bool, resume_step: int) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Inside: a function that sends a metrics row (as MetricsWriter gets it) to every ``--logger`` backend but csv.
    ``args``: the parsed TrainArgs; ``enabled``: this is rank 0 (elsewhere the function does nothing). The loggers get
    the run's flags first."""
    names = [name for name in dict.fromkeys(logger_names(args.logger)) if name != "csv"] if enabled else []
    logs, run_name = Path(args.out_dir) / "logs", Path(args.out_dir).resolve().name
    hyperparams = {f.name: flag_value(getattr(args, f.name)) for f in fields(args)}
    loggers: list[tuple[str, Any]] = []
    for name in names:
        try:
            logs.mkdir(parents=True, exist_ok=True)
            loggers.append((name, start_logger(name, logs, run_name, resume_step)))
            loggers[-1][1].log_hyperparams(hyperparams)
        except Exception as error:  # noqa: BLE001 - the backend's own failure (a server, a bad environment variable)
            for started, logger in loggers:
                finalize(started, logger, "failed")
            raise UserError(f"--logger {name} could not start: {type(error).__name__}: {error}. Fix that, or drop "
                            f"{name} from --logger (metrics.csv is written either way).") from None

    def log_row(row: dict[str, Any]) -> None:
        values = {key: float(value) for key, value in row.items() if key != "step"}
        for entry in list(loggers):
            try:
                entry[1].log_metrics(values, step=row["step"])
            except Exception as error:  # noqa: BLE001 - a server gone mid-run: metrics.csv keeps the record
                loggers.remove(entry)
                first = (str(error).splitlines() or [""])[0][:200]
                print(f"Warning: --logger {entry[0]} failed at step {row['step']} ({type(error).__name__}: {first}); "
                      "it is dropped for the rest of the run, metrics.csv keeps every row.", file=sys.stderr, flush=True)

    status = "failed"
    try:
        yield log_row
        status = "success"
    finally:
        for name, logger in loggers:
            finalize(name, logger, status)


def flag_value(value: Any) -> Any:
    """What a logger records for a flag: paths and lists as text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
