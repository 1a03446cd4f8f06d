"""Score a checkpoint on lm-evaluation-harness tasks: lm-eval builds the requests from its tasks and computes the
metrics, lit-model's inference code answers the requests (``infer/score.py`` the log-likelihoods, the continuous-batching
engine of ``infer/batching.py`` the generations).

    python evaluate/main.py --checkpoint_dir out/lora/final --tasks hellaswag,arc_easy --limit 100
    python evaluate/main.py --checkpoint_dir DIR --tasks my_task.yaml --num_fewshot 5 --batch_size auto
    python evaluate/main.py --checkpoint_dir DIR --batch_size 32 --device_memory 24GB --plan text   # will it fit?

lm-eval's results go to OUT_DIR/results.json and its table to OUT_DIR/results.md and stdout (OUT_DIR: default
CHECKPOINT_DIR/eval). A LLaMA-Adapter or unmerged LoRA checkpoint is scored with its adapter. Needs lm-eval:
pip install "lit-model[evaluate]".
"""

from __future__ import annotations

import difflib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from tqdm import tqdm

from lit_model.core.errors import UsageError, UserError, run_cli
from lit_model.core.files import atomic_write, check_out_dir_path
from lit_model.core.units import parse_memory
from lit_model.infer.batching import Engine, Event, Request, complete
from lit_model.infer.engine import Sampling
from lit_model.infer.load import (DEFAULT_CHECKPOINT, Precision, load_model, resolve_devices,
                                  resolve_generation_precision)
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE, PoolSpec, blocks_for
from lit_model.infer.score import AUTO_BATCH_SIZE, Scorer
from lit_model.infer.stream import TextStream
from lit_model.io.download import resolve_checkpoint
from lit_model.io.prompts import ChatTemplate, PromptStyle
from lit_model.io.tokenizer import Tokenizer
from lit_model.model.gpt import GPT
from lit_model.plan.evaluation import auto_batch_size, plan_evaluation
from lit_model.plan.report import check_plan_fits
from lit_model.recipes.cli import parse

RESULTS_FILE, TABLE_FILE = "results.json", "results.md"
MAX_GEN_TOKS = 256  # new tokens of a generate_until request whose task sets no max_gen_toks (lm-eval's hf default)


@dataclass
class EvaluateArgs:
    """Score a checkpoint on lm-evaluation-harness tasks.

    Args:
        checkpoint_dir: checkpoint directory (weights, model_config.yaml, tokenizer); a LLaMA-Adapter or unmerged
            LoRA saved beside the weights is applied
        tasks: lm-eval task, group or tag names (wildcards allowed) or task YAML files, comma-separated, e.g.
            hellaswag,arc_easy or my_task.yaml
        num_fewshot: examples shown before each question (default: each task's own, else 0)
        limit: score at most this many examples per task (a quick look: the scores are not the benchmark's)
        batch_size: sequences scored (and prompts of equal length generated for) together; auto: the largest (up to
            64) that the memory plan (--plan) fits on the device, halved while a batch runs out of memory
        out_dir: where results.json and results.md go (default: CHECKPOINT_DIR/eval)
        overwrite: replace the results.json and results.md an earlier evaluation wrote to --out_dir
        precision: 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true; default: the cheapest the device runs
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4 or bnb.int8: load the linear layers' weights quantized
        seed: seed of Python's, NumPy's and torch's random generators, of lm-eval's choice of few-shot examples
            and of sampling (for tasks that sample)
        apply_chat_template: render each prompt as a conversation in the checkpoint's chat template (or prompt
            style), few-shot examples as earlier turns: for chat models
        devices: GPUs to place consecutive blocks on, for models that do not fit one (CPU: 1)
        plan: text or json: print the predicted peak memory of this evaluation (the weights, a batch of requests as
            long as the context, a generation batch's KV cache) and exit without reading the weights or the tasks;
            exit status 1 when it does not fit the device and no suggested flag change makes it fit, else 0
        device_memory: with --plan: plan for a CUDA GPU of this size, e.g. 24GB (default: this machine)
    """

    checkpoint_dir: Path = DEFAULT_CHECKPOINT
    tasks: Optional[str] = None
    num_fewshot: Optional[int] = None
    limit: Optional[int] = None
    batch_size: Union[int, Literal["auto"]] = 1
    out_dir: Optional[Path] = None
    overwrite: bool = False
    precision: Optional[str] = None
    quantize: Optional[str] = None
    seed: int = 1234
    apply_chat_template: bool = False
    devices: int = 1
    plan: Optional[Literal["text", "json"]] = None
    device_memory: Optional[str] = None


def main(args: EvaluateArgs) -> None:
    specs = check_evaluate_args(args)
    if args.plan is not None:
        return print_evaluation_plan(args)
    lm_eval = import_lm_eval()
    checkpoint_dir, config = resolve_checkpoint(None, args.checkpoint_dir, DEFAULT_CHECKPOINT, plan=False)
    out_dir = Path(args.out_dir) if args.out_dir is not None else checkpoint_dir / "eval"
    check_out_dir_path(out_dir)
    written = [name for name in (RESULTS_FILE, TABLE_FILE) if (out_dir / name).exists()]
    if written and not args.overwrite:
        raise UsageError(
            f"{out_dir} already holds the results of an evaluation ({', '.join(written)}). Replace them with "
            "--overwrite, or pick another --out_dir."
        )
    devices = resolve_devices(args.devices)
    precision = resolve_generation_precision(args.precision, devices[0].type, args.quantize)
    batch_size = args.batch_size
    if batch_size == "auto":  # memory available now, before the weights take theirs
        batch_size = auto_batch_size(config, precision.name, args.quantize, None, devices[0].type,
                                     len(devices))
        print(f"--batch_size auto: {batch_size} (the largest the memory plan fits, halved if a batch runs out of "
              "memory)", file=sys.stderr, flush=True)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_checkpoint(checkpoint_dir, config)
    manager, tasks = load_tasks(specs)  # reads (and on first use downloads) the data, before the weights

    torch.manual_seed(args.seed)
    model = load_model(checkpoint_dir, devices, precision.dtype, args.quantize, decoding=True)
    lm = harness_model(model, tokenizer, style, precision, None if args.batch_size == "auto" else batch_size,
                       args.seed, checkpoint_dir, auto_start=batch_size)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot, limit=args.limit,
        batch_size=args.batch_size, apply_chat_template=args.apply_chat_template, log_samples=False,
        random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    for line in lm.summary():
        print(line, file=sys.stderr, flush=True)

    from lm_eval.utils import handle_non_serializable, make_table

    table = make_table(results) + (f"\n{make_table(results, 'groups')}" if results.get("groups") else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / RESULTS_FILE, json.dumps(
        strict_json(results), indent=2, default=handle_non_serializable, ensure_ascii=False, allow_nan=False) + "\n")
    atomic_write(out_dir / TABLE_FILE, table)
    print(table)
    print(f"Results written to {out_dir / RESULTS_FILE}", file=sys.stderr)


def check_evaluate_args(args: EvaluateArgs) -> list[str]:
    """The flags that need no file, checked first; returns --tasks as a list (which --plan does without)."""
    specs = [spec.strip() for spec in (args.tasks or "").split(",") if spec.strip()]
    if not specs and args.plan is None:
        raise UsageError(
            "--tasks names no task. Give lm-eval task names or task YAML files, comma-separated, e.g. --tasks "
            "hellaswag,arc_easy (`lm-eval ls tasks` lists them)."
        )
    for flag, value, least in (("num_fewshot", args.num_fewshot, 0), ("limit", args.limit, 1),
                               ("batch_size", None if args.batch_size == "auto" else args.batch_size, 1),
                               ("seed", args.seed, 0), ("devices", args.devices, 1)):
        if value is not None and value < least:
            raise UsageError(f"--{flag} {value} must be at least {least}.")
    if args.seed >= 2**32:
        raise UsageError(f"--seed {args.seed} must be below 2**32 (NumPy's seeds are 32-bit).")
    if args.device_memory is not None:
        if args.plan is None:
            raise UsageError(
                f"--device_memory {args.device_memory} applies with --plan only (to plan an evaluation for another "
                "device). Evaluating runs on this machine's."
            )
        parse_memory(args.device_memory)
    return specs


def print_evaluation_plan(args: EvaluateArgs) -> None:
    """--plan text|json: the predicted peak memory of evaluating with these flags, from the checkpoint's config
    (neither its weights nor the tasks are read), on a CUDA GPU of --device_memory or this machine's device."""
    _, config = resolve_checkpoint(None, args.checkpoint_dir, DEFAULT_CHECKPOINT, plan=True)
    device_type = "cuda" if args.device_memory or torch.cuda.is_available() else "cpu"
    if device_type == "cpu" and args.devices > 1:
        resolve_devices(args.devices)  # the one-paragraph error: the CPU is one device
    precision = resolve_generation_precision(args.precision, device_type, args.quantize, planning=True)
    batch_size = args.batch_size
    if batch_size == "auto":
        batch_size = auto_batch_size(config, precision.name, args.quantize, args.device_memory,
                                     device_type, args.devices)
    plan = plan_evaluation(config, batch_size, precision.name, args.quantize, args.device_memory,
                           device_type, devices=args.devices)
    if args.batch_size == "auto":
        plan.notes.append(f"--batch_size auto: {batch_size}, the largest power of two up to {AUTO_BATCH_SIZE} "
                          "whose plan fits.")
    print(plan.to_json() if args.plan == "json" else plan.to_text())
    check_plan_fits(plan)


def import_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise UserError(
            "lit-model evaluate runs lm-evaluation-harness, which is not installed. Install it with "
            "pip install \"lit-model[evaluate]\" (or pip install \"lm-eval>=0.4.13,<0.5\") and run again."
        ) from None
    return lm_eval


def load_tasks(specs: list[str]) -> tuple[Any, list[Any]]:
    """lm-eval's task manager and the tasks and groups ``specs`` name, built (their data read) and checked before
    the weights are loaded. A spec that ends in .yaml/.yml or names a file is a task file of the user's, loaded on
    its own (with the files it includes); the built-in tasks are indexed only when a name asks for them (seconds)."""
    from lm_eval.tasks import TaskManager

    paths = [spec for spec in specs if spec.endswith((".yaml", ".yml")) or Path(spec).is_file()]
    for path in paths:
        if not Path(path).is_file():
            raise UsageError(f"--tasks {path}: no such task file. Pass the path of an lm-eval task YAML.")
    names = [spec for spec in specs if spec not in paths]
    manager = TaskManager(include_defaults=bool(names))
    expanded = []
    for name in names:
        matches = manager.match_tasks([name])  # an exact name, or what a wildcard (arc_*) matches
        if not matches:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise UsageError(
                f"Unknown task {name!r}.{hint} `lm-eval ls tasks` lists the {len(manager.all_tasks):,} tasks, groups "
                "and tags lm-eval knows; a task of your own is given as its YAML file (--tasks path/to/task.yaml)."
            )
        expanded += [match for match in matches if match not in expanded]
    try:
        loaded = manager.load([*expanded, *paths])
    except Exception as error:  # lm-eval's, the data set library's, the network's: the tasks named cannot be read
        raise UserError(
            f"lm-eval could not load the tasks {', '.join(specs)}: {type(error).__name__}: {error}. A built-in task "
            "downloads its data set from the Hugging Face Hub on first use (check the connection, or "
            "HF_DATASETS_OFFLINE with a cached copy); a task file must be a valid lm-eval task YAML."
        ) from error
    children = {child for kids in loaded.get("group_map", {}).values() for child in kids}
    members = {**loaded.get("groups", {}), **loaded["tasks"]}
    return manager, [item for name, item in members.items() if name not in children]


def strict_json(value: Any) -> Any:
    """``value`` with NaN and infinities as None: results.json is strict JSON (null, never NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


class HarnessModel:
    """lit-model's inference code answering lm-eval's requests. ``harness_model`` makes it an lm-eval model (a
    ``TemplateLM``, which turns (context, continuation) texts into tokens as lm-eval's ``hf`` model does); the
    class is joined to lm-eval's only then, as lm-eval is optional."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, style: PromptStyle, precision: Precision,
                 batch_size: Optional[int], seed: int, checkpoint_dir: Path, auto_start: int = AUTO_BATCH_SIZE) -> None:
        super().__init__()  # lm-eval's LM: rank 0 of 1
        if tokenizer.bos_id is None and tokenizer.eos_id is None:
            raise UserError(
                f"The tokenizer in {checkpoint_dir} has neither a bos nor an eos token, one of which lm-eval scores a "
                "text's first token after. Add bos_token or eos_token to its tokenizer_config.json."
            )
        self.model, self.tokenizer, self.style, self.precision = model, tokenizer, style, precision
        self.seed, self.checkpoint_dir = seed, checkpoint_dir
        self.scorer = Scorer(model, precision, batch_size, auto_start)
        self.generated, self.generate_seconds = 0, 0.0

    # ---- tokens, as lm-eval's hf model makes them ------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id if self.tokenizer.eos_id is not None else self.tokenizer.bos_id

    @property
    def prefix_token_id(self) -> int:
        """What a text is scored after: bos, else eos (as lm-eval's hf model)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        """The checkpoint's own encoding (bos where its tokenizer adds one), or without special tokens when asked."""
        return self.tokenizer.encode(string, bos=False if add_special_tokens is False else None).tolist()

    @property
    def tokenizer_name(self) -> str:  # lm-eval keys its cache of chat-templated requests by it
        return f"lit-model:{self.checkpoint_dir.resolve()}:{self.style.name}"

    # ---- requests ----------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        with tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm) as bar:
            scores = self.scorer.continuations([(context, continuation) for _, context, continuation in requests],
                                               bar.update)
        return [(score.logprob, score.greedy) for score in scores]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        texts = [self.tok_encode(string) for (string,) in (request.args for request in requests)]
        with tqdm(desc="loglikelihood_rolling (windows)", disable=disable_tqdm) as bar:
            return self.scorer.rolling(texts, self.prefix_token_id, bar.update)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, ended by an eos token, a stop string (``until``, cut off) or ``max_gen_toks``;
        greedy unless the task samples (``do_sample``). All run through the continuous-batching engine
        (infer/batching.py): up to the batch size decode together, in a pool of batch size x the context (what
        the plan counts), a request joining the batch as another ends, whatever its prompt's length."""
        from lm_eval.models.utils import normalize_gen_kwargs

        context_size = self.model.max_seq_length
        queued = []
        for i, request in enumerate(requests):
            kwargs = normalize_gen_kwargs(request.args[1], MAX_GEN_TOKS)
            if kwargs["max_gen_toks"] >= context_size:
                raise UserError(
                    f"A task asks for up to {kwargs['max_gen_toks']} new tokens (max_gen_toks), which leaves no room "
                    f"for its prompt in the model's context of {context_size} tokens. Evaluate this model on other "
                    "tasks."
                )
            prompt = self.tok_encode(request.args[0])[-(context_size - kwargs["max_gen_toks"]):]
            sampled = bool(kwargs.get("do_sample"))
            sampling = Sampling(temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                                top_k=kwargs.get("top_k"), top_p=float(kwargs.get("top_p", 1.0)), seed=self.seed + i)
            queued.append((Request(str(i), tuple(prompt or [self.prefix_token_id]), kwargs["max_gen_toks"], sampling,
                                   tuple(self.tokenizer.eos_ids)), kwargs["until"]))  # lm-eval cuts from the left
        size = self.scorer.batch_size or self.scorer.auto_start
        pool = PoolSpec(size * blocks_for(context_size, DEFAULT_BLOCK_SIZE))
        engine = Engine(self.model, self.precision, pool, max_batch=size, prefix_caching=True)  # few-shot prefixes
        streams = {r.id: TextStream(self.tokenizer, until, context=r.prompt_ids[-4:]) for r, until in queued}
        with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm) as bar:

            def on_event(event: Event) -> None:
                if any([streams[event.id].add(token) for token in event.tokens]) and event.finish_reason is None:
                    engine.cancel(event.id)  # a stop string ended it
                bar.update(event.finish_reason is not None)

            try:
                _, timing = complete(engine, [r for r, _ in queued], on_event)
            finally:
                self.model.clear_kv_cache()  # its memory goes back to the scoring batches
        self.generated += timing.tokens
        self.generate_seconds += timing.seconds
        return [streams[str(i)].finish() for i in range(len(requests))]

    # ---- chat ----------------------------------------------------------------------------------------
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation in the checkpoint's chat template (or prompt style). Without ``add_generation_prompt``
        the last (assistant) message is left open for the model to continue, as transformers'
        ``continue_final_message`` leaves it."""
        text = self.style.apply_chat(chat_history, add_generation_prompt=add_generation_prompt)
        if add_generation_prompt or not chat_history or chat_history[-1]["role"] != "assistant":
            return text
        last = chat_history[-1]["content"]
        return text[: text.rindex(last) + len(last)] if last in text else text

    def chat_template(self, chat_template: Union[bool, str] = False) -> str:
        """What lm-eval records as the chat template in the results."""
        return self.style.template if isinstance(self.style, ChatTemplate) else f"prompt style {self.style.name}"

    def get_model_info(self) -> dict[str, Any]:
        """Added to the results' config."""
        return {"checkpoint_dir": str(self.checkpoint_dir), "precision": self.precision.name,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters())}

    def summary(self) -> list[str]:
        """The speed of each kind of request that ran."""
        lines = [self.scorer.summary()] if self.scorer.requests else []
        if self.generate_seconds > 0:
            lines.append(f"generation: {self.generated:,} new tokens in {self.generate_seconds:.1f} s: "
                         f"{self.generated / self.generate_seconds:.1f} tokens/s")
        return lines


def harness_model(model: GPT, tokenizer: Tokenizer, style: PromptStyle, precision: Precision,
                  batch_size: Optional[int], seed: int, checkpoint_dir: Path, auto_start: int = AUTO_BATCH_SIZE) -> Any:
    """A ``HarnessModel`` that is an ``lm_eval.api.model.TemplateLM`` (lm-eval imported here: it is optional)."""
    from lm_eval.api.model import TemplateLM

    cls = type("LitModelLM", (HarnessModel, TemplateLM), {"__module__": __name__})
    return cls(model, tokenizer, style, precision, batch_size, seed, checkpoint_dir, auto_start)


def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> EvaluateArgs -> main; one paragraph and an exit status on bad
    input. ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(EvaluateArgs, sys.argv[1:] if argv is None else list(argv), prog)))
