"""Engine (b): closed-form bytes from the config and the flags. Fast (microseconds), so it plans 70B models,
FSDP sharding, CPU offload and many GPUs, and runs inside the suggestion search.

It adds up the memory contracts the model's module classes publish beside their own code (``memory_contract``:
``lit_model/model/contracts.py``; LoRA's, the adapter's and bitsandbytes' in ``lit_model/methods``): parameters,
and the tensors each block keeps for backward. What it knows itself is the training step: which parameters train,
the optimizer's state, and the transients at the moments a step peaks:

* end of forward / the loss: every block's kept tensors + one loss chunk's logits in flight;
* the backward of the loss chunk: kept tensors + recomputed chunk logits, their gradient (12 bytes per logit);
* the backward of the last block (with activation checkpointing: its recomputed activations);
* the end of backward and the optimizer step: all gradients (+ the optimizer's temporaries);

and how FSDP shards, offloading and activation checkpointing change them. ``tests/test_memory_plan.py`` checks it
against the trace (``trace.py``) across architectures and flags.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from lit_model.core.config import Config
from lit_model.methods.adapter import AdapterAttention
from lit_model.methods.lora import LoRALayer
from lit_model.model.contracts import ParamCounts, Saved, Step
from lit_model.model.gpt import GPT, Block, CausalSelfAttention, Linear, norm_contract
from lit_model.parallel.activations import MIN_OFFLOAD_BYTES
from lit_model.plan.calibration import quantized_step_bytes
from lit_model.plan.modules import QuantLinearSim, lora_target_names
from lit_model.run import Run

# What the bytes are. "quantization": bitsandbytes' statistics and dequantized weights in flight; "checkpoint":
# parameters gathered for a full state dict; "kv_cache": generation only; "overhead": not tensors (calibration.py).
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "logits_loss", "quantization", "kv_cache",
              "checkpoint", "overhead")


# ---- parameters ------------------------------------------------------------------------------------
def param_counts(config: Config) -> ParamCounts:
    return GPT.memory_contract(config)


def _frozen_blocks(spec: Run) -> tuple[bool, int]:
    """(embedding frozen, number of leading blocks frozen) for ``--freeze_layers N`` (patterns: not modelled)."""
    if spec.trainable != "full":
        return True, spec.config.n_layer
    if isinstance(spec.freeze_layers, int):
        return True, spec.freeze_layers
    return False, 0


@dataclass(frozen=True)
class ModelBytes:
    params: int  # resident parameter bytes (quantized weights packed), buffers included
    quant_state: int  # absmax & co.
    trainable: int  # trainable elements
    trainable_tensors: list[int] = field(default_factory=list)  # element counts, for optimizer rules
    block_matrices: list[tuple[int, int]] = field(default_factory=list)  # trainable blocks' weights (GaLore, APOLLO)
    frozen_linear_max: int = 0  # largest frozen quantized linear (elements): dequantization workspace
    largest_param: int = 0  # elements of the largest single parameter (FSDP full-state-dict gather)
    block_params: int = 0  # bytes of one block's parameters (FSDP gathers)
    root_params: int = 0  # bytes of embedding + final norm + head (FSDP root group)


def model_bytes(spec: Run) -> ModelBytes:
    config, d = spec.config, spec.param_bytes
    pc = param_counts(config)
    C, V, L = config.n_embd, config.padded_vocab_size, config.n_layer
    quant = spec.quantize
    trainable_tensors: list[int] = []
    block_matrices: list[tuple[int, int]] = []
    frozen_embed, frozen_blocks = _frozen_blocks(spec)
    lora_names = set(lora_target_names(config, spec.lora_targets)) if spec.trainable == "lora" else set()
    r = spec.lora_r
    block_lora = [LoRALayer.parameter_sizes(r, i, o, spec.lora_dora)
                  for name, (i, o, _) in pc.block_linear.items() if name in lora_names]
    lora_head = spec.trainable == "lora" and "head" in spec.lora_targets
    head_lora = LoRALayer.parameter_sizes(r, C, V, spec.lora_dora) if lora_head else []

    # per block
    block_bytes, block_quant, frozen_max = 0, 0, 0
    for i, o, bias in pc.block_linear.values():
        if quant is not None:
            packed, state = QuantLinearSim.memory_contract(i, o, quant)
            block_bytes += packed + (o * d if bias else 0)
            block_quant += state
            frozen_max = max(frozen_max, i * o)
        else:
            block_bytes += Linear.memory_contract(i, o, bias) * d
    block_bytes += (sum(map(sum, block_lora)) + pc.block_norms) * d
    root = (pc.embed + pc.head + pc.norm_f + sum(head_lora)) * d
    params = L * block_bytes + root + GPT.buffer_bytes(config, spec.seq_len)
    quant_state = L * block_quant

    # trainable tensors (element counts), in the order the optimizer sees them
    if spec.trainable == "full":
        if not frozen_embed:
            trainable_tensors.append(pc.embed)
        for b in range(frozen_blocks, L):
            for i, o, bias in pc.block_linear.values():
                trainable_tensors += [i * o] + ([o] if bias else [])
                block_matrices.append((i, o))
            trainable_tensors += pc.block_norm_sizes
        trainable_tensors += norm_contract(config).parameter_sizes(C)
        if pc.head:
            trainable_tensors += [V * C] + ([V] if config.lm_head_bias else [])
    elif spec.trainable == "lora":
        trainable_tensors += [n for _ in range(L) for sizes in block_lora for n in sizes] + head_lora
    else:  # adapter (litgpt's LLaMA-Adapter: a prompt per layer from adapter_start_layer, and a gate)
        for _ in range(spec.adapter_start_layer, L):
            trainable_tensors += AdapterAttention.parameter_sizes(config, spec.adapter_prompt_length)
        params += sum(trainable_tensors) * d
    largest = max([pc.embed, pc.head] + [i * o for i, o, _ in pc.block_linear.values()])
    return ModelBytes(
        params=params, quant_state=quant_state, trainable=sum(trainable_tensors), trainable_tensors=trainable_tensors,
        block_matrices=block_matrices,
        frozen_linear_max=frozen_max, largest_param=largest, block_params=block_bytes + block_quant, root_params=root,
    )


# ---- optimizer ------------------------------------------------------------------------------------
def optimizer_state_bytes(spec: Run, tensors: list[int], block_matrices: list[tuple[int, int]] = ()) -> int:
    """Persistent optimizer state for trainable tensors of these element counts (``block_matrices``: the shapes of
    the blocks' trainable weights among them, which GaLore and APOLLO project)."""
    d = spec.param_bytes
    name = spec.optimizer
    total = 0
    for n in tensors:
        if name in ("AdamW8bit", "PagedAdamW8bit"):
            # bitsandbytes: uint8 moments + fp32 absmax per 256 elements; fp32 moments below 4096 elements
            total += 2 * n + 2 * 4 * math.ceil(n / 256) if n >= 4096 else 8 * n
        elif name in ("AdamW4bit", "AdamWFp8"):
            # torchao: per moment 4-bit codes + an fp32 scale per 128 (+ a 16-entry map), or float8 codes + an fp32
            # scale per 256, for tensors of >= 4096 elements in whole blocks; else moments in the parameter's dtype
            block = 128 if name == "AdamW4bit" else 256
            if n >= 4096 and n % block == 0:
                total += 2 * (n // 2 + 4 * (n // 128) + 64) if name == "AdamW4bit" else 2 * (n + 4 * (n // 256))
            else:
                total += 2 * d * n
            total += 4  # the step count
        elif name == "AdamMini":
            total += 4 * n + 8  # an fp32 first moment; one second moment per head or tensor (+ its size)
        elif name == "AdaLomo":  # a factored fp32 second moment (rows + columns; every matrix here has a side of
            # n_embd), no first
            C = spec.config.n_embd
            total += 4 * (n // C + C) if n >= 4096 and n % C == 0 else 4 * n
        elif name == "SGD":
            total += d * n  # momentum buffer
        elif name == "Lion":
            total += d * n  # one moment
        elif name == "Adafactor":
            total += d * n if n < 4096 else int(2 * math.sqrt(n)) * d  # factored second moment (rows + cols)
        else:  # AdamW, Sophia (moment + hessian), GaLore / APOLLO before projection, class paths: two moments
            total += 2 * d * n
    if name in ("GaLore", "APOLLO"):
        rank = spec.optimizer_rank
        for i, o in block_matrices:  # projected: moments of rank x the longer side, and the projection
            if min(i, o) > rank:
                total += (2 * rank * max(i, o) + rank * min(i, o)) * d - 2 * d * i * o
    if name == "AdamMini" and spec.trainable == "full":  # the embedding and the head keep a full second moment
        frozen_embed, _ = _frozen_blocks(spec)
        counts = param_counts(spec.config)
        total += 4 * (counts.head + (0 if frozen_embed else counts.embed))
    if name in ("AdamW", "Sophia"):
        total += 4 * len(tensors)  # fused AdamW's per-parameter `step` scalars
    return total


def optimizer_step_bytes(spec: Run, mb: "ModelBytes") -> int:
    """Temporaries of the optimizer step on top of its state, for the lean optimizers (fused AdamW and the
    block-quantized kernels keep none; the older optimizers are not modelled): GaLore's and APOLLO's foreach step
    over the tensors they do not project keeps two or three tensors of their size at once (of one of them, stepped in
    backward; the trace of a tiny GPT shows a third); Adam-mini and AdaLomo step one tensor at a time in fp32, and so
    do the block-quantized ones on the CPU, and torchao's on a GPU (calibration.quantized_step_bytes)."""
    name, d = spec.optimizer, spec.param_bytes
    largest = max(mb.trainable_tensors, default=0)
    if name in ("GaLore", "APOLLO"):
        rank = spec.optimizer_rank
        projected = sum(i * o for i, o in mb.block_matrices if min(i, o) > rank)
        return 3 * d * (largest if spec.optimizer_in_backward else mb.trainable - projected)
    if name in ("AdamMini", "AdaLomo"):
        return 2 * 4 * largest
    # the block-quantized optimizers' CPU step (and torchao's compiled GPU step) widens one tensor at a time
    return quantized_step_bytes(name, largest, d, spec.device_type)


# ---- activations ---------------------------------------------------------------------------------------
def step_of(spec: Run, batch: int) -> Step:
    """What the model's contracts need to know of this run, at micro batch ``batch``."""
    lora = set(lora_target_names(spec.config, spec.lora_targets)) if spec.trainable == "lora" else set()
    lora |= {re.sub(r"experts\.\d+\.", "", name) for name in lora}  # an expert's path is an MLP's (times k)
    return Step(batch=batch, seq_len=spec.seq_len, param_bytes=spec.param_bytes, compute_bytes=spec.compute_bytes,
                autocast=spec.autocast_dtype is not None, attention_dtype=spec.autocast_dtype or spec.param_dtype,
                device_type=spec.device_type, norm_tokens=spec.micro_batch_size * spec.seq_len, packing=spec.packing,
                mlp_tiles=spec.mlp_tiles, lora_names=frozenset(lora), lora_r=spec.lora_r,
                lora_dropout=spec.lora_dropout, lora_dora=spec.lora_dora)


@dataclass(frozen=True)
class ActivationSummary:
    kept: float  # bytes kept for backward at the end of forward (all blocks, norm_f, embeddings)
    block_backward: float  # extra bytes during the backward of the last block (recompute + gradients in flight)
    loss_forward: float  # logits etc. in flight at the loss in forward
    loss_backward: float  # in backward of one loss chunk
    eval_forward: float  # activations in flight in a no-grad forward (eval / generation prefill)
    eval_loss: float
    first_block: float = 0.0  # bytes in flight during the backward of block 0 (the last one backward reaches)
    weight_copies: float = 0.0  # -mixed: half-precision copies of the weights kept for backward
    weight_cache: float = 0.0  # -mixed: further copies autocast caches until the end of the forward
    offloaded: float = 0.0  # bytes activation offloading holds outside the device at the end of forward


def activations(spec: Run, batch: Optional[int] = None) -> ActivationSummary:
    config = spec.config
    B = batch if batch is not None else spec.micro_batch_size
    T = spec.seq_len
    N = B * T
    d = spec.param_bytes
    C, I, V, L = config.n_embd, config.intermediate_size, config.padded_vocab_size, config.n_layer
    frozen_embed, frozen_blocks = _frozen_blocks(spec)
    x_rg = not frozen_embed  # embedding output requires grad when the embedding trains
    last = None
    block_kept = []
    offloaded = 0.0
    # activation offloading moves every saved tensor of at least MIN_OFFLOAD_BYTES: at this size, all but the norms'
    # per-token statistics (fp32, up to four per block) and a logsumexp of few heads
    offloads = spec.activation_offloading is not None and N * C * spec.compute_bytes >= MIN_OFFLOAD_BYTES
    stays = (16 + (config.n_head * 4 if config.n_head * 4 * N < MIN_OFFLOAD_BYTES else 0)) * N
    step = step_of(spec, B)
    cache: dict[tuple, Saved] = {}  # blocks are alike: compute each kind once
    for layer in range(L):
        block_trainable = spec.trainable == "full" and layer >= frozen_blocks
        adapter = spec.trainable == "adapter" and layer >= spec.adapter_start_layer
        key = (x_rg, block_trainable, adapter, config.layer_uses_sliding_window(layer), config.layer_uses_rope(layer))
        if key not in cache:
            attention = AdapterAttention if adapter else CausalSelfAttention
            cache[key] = Block.memory_contract(config, step, layer, x_rg, block_trainable, attention,
                                               LoRALayer.memory_contract)
        acts = cache[key]
        this = acts.per_token * N + acts.per_sample_t2 * B + acts.per_layer
        checkpointed = spec.ac_interval > 0 and layer % spec.ac_interval == 0 and (x_rg or acts.out_requires_grad)
        block_input = C * d * N  # kept by a checkpoint
        if checkpointed and spec.ac_selective:  # the input offloads, the matmul outputs stay
            kept_here = acts.selective_per_token * N + acts.per_sample_t2 * B + acts.per_layer
            moved = block_input if offloads else 0.0
        elif checkpointed:
            kept_here = moved = block_input
        else:
            kept_here = this
            moved = max(this - stays, 0.0)
        moved = moved if offloads else 0.0
        block_kept.append(kept_here - moved)
        offloaded += moved
        last = (this, acts.transient_per_token * N, checkpointed or moved > 0)
        if layer == 0:
            first = (this, acts.transient_per_token * N)
        x_rg = acts.out_requires_grad
    kept = sum(block_kept) + 16 * N  # + the batch: input ids and targets (int64)
    packed = 0
    if spec.packing:  # the positions, per-token cos/sin and the document masks (one per window, shared by the layers)
        window = config.sliding_window_size
        masks = 1 + (window is not None and window < T)
        packed = 8 * N + (2 * N * config.rope_n_elem + masks * B * T * T) * spec.compute_bytes
        kept += packed
    differentiated_twice = spec.optimizer == "Sophia"
    if differentiated_twice:
        # Estimate (not traced): on Hessian steps backward runs with create_graph=True, keeping the backward
        # graph (about as much again), and the fit loop switches to the math attention kernel, which keeps the
        # attention probabilities (T x T per head).
        kept = 2 * kept + L * B * config.n_head * T * T * 2 * spec.compute_bytes
    # final norm + its output kept by the loss checkpoint (or by the head)
    head_train = spec.trainable == "full" or (spec.trainable == "lora" and "head" in spec.lora_targets)
    kept_nf, out_rg = norm_contract(config).memory_contract(config, step, d, x_rg, spec.trainable == "full", C)
    kept += kept_nf * N
    if out_rg or head_train:
        kept += C * d * N  # norm_f output
    this, transient, checkpointed = last
    block_backward = transient + (this if checkpointed else 0.0)
    first_block = first[0] + first[1]  # block 0 in backward: its kept (or recomputed) tensors + transient
    c = min(spec.loss_chunk_size or N, N)  # tokens per loss chunk
    vc = V * C * d if head_train else 0
    autocast = spec.autocast_dtype is not None
    softcap = config.final_logit_softcapping is not None
    # Both loss paths, measured with the trace: a chunk holds its fp32 logits and their log-probabilities (8
    # bytes per logit; soft-capping keeps its tanh too: 12).
    chunk_logits = (12.0 if softcap else 8.0) * c * V
    fused = not (spec.trainable == "lora" and "head" in spec.lora_targets) and not differentiated_twice
    if fused:
        # lit_model/model/loss.py: the gradients of the final norm's output and of the head's weight are made in the
        # forward, chunk by chunk, and only scaled in backward. Under autocast it casts the head's weight (and
        # each chunk's input) to half precision itself.
        loss_forward = chunk_logits + (N * C * d if out_rg else 0.0) + vc
        if autocast:
            loss_forward += spec.compute_bytes * (V * C + c * C)
        loss_backward = (N * C * d if out_rg else 0.0) + vc
    elif c < N:
        # checkpointed chunks: in backward a chunk recomputes its logits and adds their gradients (12 bytes per
        # logit). With a trainable head, its weight gradient sits in autograd's buffer while the chunks are
        # summed (up to three V x C tensors at once when a chunk's gradient is added). The gradient of the whole
        # final-norm output (N x C) fills up chunk by chunk.
        loss_forward = chunk_logits
        # with a trainable head, also max(one V x C gradient in autograd's buffer, the sum of the buffer and
        # a chunk's new gradient: three V x C tensors at once)
        loss_backward = max(12.0 * c * V + vc, 3.0 * vc + c * C * d) if head_train else 12.0 * c * V
        loss_backward += N * C * d
    else:
        loss_forward = chunk_logits
        loss_backward = max(12.0 * N * V, 8.0 * N * V + vc + N * C * d)
    if autocast and not fused:  # the head's weight cast to half precision for each chunk
        loss_forward += spec.compute_bytes * V * C
        loss_backward += spec.compute_bytes * V * C
    weight_copies, weight_cache = 0.0, 0.0
    if spec.autocast_dtype is not None:
        # autocast casts each linear weight to half precision: the linears keep those copies for their input's
        # gradient (none with activation checkpointing), and while the forward runs autocast also caches the
        # copies of trainable weights (the head's included), up to the end of the loss.
        pc = param_counts(config)
        blocks = 2.0 * L * pc.block_linear_weights
        weight_copies = 0.0 if spec.ac_interval else blocks
        if spec.trainable == "full":
            weight_cache = blocks - weight_copies + (0.0 if fused else 2.0 * V * C)
    # no-grad forward: the largest set of tensors alive at once inside a block (MLP: 3 intermediates)
    if config.mlp_class_name == "GptNeoxMLP":
        eval_fw = N * (2 * I + 3 * C) * d
    else:
        eval_fw = N * (3 * I + 3 * C) * d
    if config.mlp_class_name == "LLaMAMoE":  # one expert at a time, on at most every token; plus the dispatch: the
        # gathered input, the weighted output, the running sum and its update, the router's probabilities and top k
        eval_fw += N * (4 * C * d + 8 * config.n_expert + 16 * config.n_expert_per_token)
    if config.attention_logit_softcapping is not None:
        eval_fw = max(eval_fw, B * config.n_head * T * T * (d + 4 + d))
    eval_fw += packed  # alive for the whole forward, the loss included
    eval_loss = chunk_logits + packed  # a no-grad chunk: its logits and log-probabilities, on either path
    if spec.autocast_dtype is not None:
        # autocast caches half-precision copies of weights that require grad, also under no_grad
        pc = param_counts(config)
        cached = 2.0 * (L * pc.block_linear_weights + V * C) if spec.trainable == "full" else 2.0 * V * C
        eval_fw += cached
        eval_loss += cached
    return ActivationSummary(
        kept=kept, block_backward=block_backward, loss_forward=loss_forward,
        loss_backward=loss_backward, eval_forward=eval_fw, eval_loss=eval_loss, weight_copies=weight_copies,
        weight_cache=weight_cache,
        first_block=first_block, offloaded=offloaded,
    )


# ---- phases ------------------------------------------------------------------------------------------
def _empty() -> dict[str, float]:
    return {c: 0.0 for c in CATEGORIES}


def _max_phase(candidates: list[dict[str, float]]) -> dict[str, int]:
    best = max(candidates, key=lambda c: sum(c.values()))
    return {k: int(round(v)) for k, v in best.items()}


def _sharding(spec: Run) -> int:
    """How many ranks share one copy of the parameters/gradients/optimizer state."""
    return spec.parallel.dp_shard


def training_phases(spec: Run) -> dict[str, dict[str, int]]:
    """Tensor bytes per rank at the peak of each phase, by category (no framework overhead)."""
    config = spec.config
    d = spec.param_bytes
    C, V = config.n_embd, config.padded_vocab_size
    N = spec.micro_batch_size * spec.seq_len
    mb = model_bytes(spec)
    acts = activations(spec)
    grad_bytes = mb.trainable * d
    opt = optimizer_state_bytes(spec, mb.trainable_tensors, mb.block_matrices)
    head_trainable = spec.trainable == "full"
    head_grad = V * C * d if head_trainable else 0
    dequant = mb.frozen_linear_max * spec.compute_bytes if spec.quantize else 0
    shards = _sharding(spec)

    # resident state of this rank
    params = float(mb.params)
    quant_state = float(mb.quant_state)
    grads_persist = float(grad_bytes) if spec.accumulation > 1 else 0.0
    buckets = 0.0
    grads_all = float(grad_bytes)
    optimizer = float(opt)
    gathered = 0.0  # FSDP: unsharded parameters alive on top of the shards
    gathered_end = 0.0
    if spec.parallel.fsdp:
        params, quant_state, optimizer = params / shards, quant_state / shards, optimizer / shards
        grads_persist, grads_all = grads_persist / shards, grads_all / shards
        head_grad = head_grad / shards
        # FSDP2 keeps the root group (embedding, final norm, head) gathered through forward and backward, and
        # gathers the current and the prefetched block; SHARD_GRAD_OP keeps every block gathered after forward.
        blocks_gathered = 2 if spec.parallel.reshards_after_forward else config.n_layer
        gathered = mb.root_params + blocks_gathered * mb.block_params
        gathered_end = mb.root_params + 2 * mb.block_params
        if spec.trainable == "full":
            gathered += mb.block_params  # a block's unsharded gradients before their reduce-scatter
        if spec.parallel.cpu_offload:
            # shards, gradients and optimizer state live in CPU memory; the device holds gathered parameters
            params, quant_state, optimizer, grads_persist, grads_all, head_grad = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    elif spec.parallel.ddp:
        # DDP's all-reduce buckets, allocated when it wraps the model; the gradients are views into them
        buckets = float(grad_bytes)
        grads_persist = buckets

    def point(activ: float = 0.0, logits: float = 0.0, grads: float = 0.0, quant_extra: float = 0.0, gather: float = 0.0,
              copies: bool = True, step: float = 0.0):
        c = _empty()
        c["parameters"] = params + gather
        c["quantization"] = quant_state + quant_extra
        c["gradients"] = max(grads, grads_persist)
        c["optimizer_state"] = optimizer + step
        c["activations"] = activ + (acts.weight_copies if copies else 0.0)
        c["logits_loss"] = logits
        return c

    xf_grad = N * C * d
    block_grads = grad_bytes / shards / max(config.n_layer, 1)  # about one block's gradients (and the head's)
    embed_grad = 0.0 if config.tie_embeddings or _frozen_blocks(spec)[0] else V * C * d / shards
    inputs = 16.0 * N
    tied_trainable = config.tie_embeddings and spec.trainable == "full" and not _frozen_blocks(spec)[0]
    if spec.steps_in_backward:
        # each gradient is stepped on and freed once complete: about one parameter's gradient at a time (AdaLomo
        # steps the previous one when the next arrives: two), but a tied embedding's is complete only at the end
        in_flight = (2 if spec.optimizer == "AdaLomo" else 1) * mb.largest_param * d
        head_grad = V * C * d if tied_trainable else 0.0
        block_grads, embed_grad = in_flight, 0.0
        grads_all = head_grad + in_flight
    candidates = [
        # end of forward: the loss chunk in flight
        point(acts.kept + acts.weight_cache, acts.loss_forward, gather=gathered),
        # backward through the loss
        point(acts.kept, acts.loss_backward, gather=gathered),
        # backward of the last block (recomputed when checkpointed)
        point(acts.kept + xf_grad + acts.block_backward, 0.0, grads=head_grad + block_grads, quant_extra=dequant, gather=gathered),
        # backward of block 0: nearly every gradient exists, one block's tensors are still in flight
        point(inputs + xf_grad + acts.first_block, 0.0, grads=grads_all - embed_grad, quant_extra=dequant, gather=gathered,
              copies=False),
        # end of backward: a tied embedding's gradient is added in place to the head's (two V x C tensors at
        # once, one of them still in autograd's buffer); then the optimizer step (fused AdamW: no temporaries)
        point(inputs + (V * C * d / shards if tied_trainable else 0.0), 0.0, grads=grads_all, gather=gathered_end,
              copies=False, step=optimizer_step_bytes(spec, mb) / shards),
    ]
    train = _max_phase(candidates)
    train["activations"] = max(train["activations"], 0)

    # evaluation: a no-grad forward of eval_batch (gradients were freed by zero_grad)
    ev = activations(spec, batch=spec.eval_batch)
    eb_tokens = spec.eval_batch * spec.seq_len
    eval_params = params + (mb.root_params + 2 * mb.block_params if spec.parallel.fsdp else 0)
    e = _empty()
    e["parameters"] = eval_params
    e["quantization"] = quant_state + dequant
    e["optimizer_state"] = optimizer
    e["gradients"] = buckets  # DDP's buckets stay allocated; the gradients were freed by zero_grad
    inputs_eval = 16.0 * eb_tokens + inputs  # the evaluation batch and the last training batch
    if ev.eval_forward > eb_tokens * C * d + ev.eval_loss:  # peak inside a block
        e["activations"] = inputs_eval + ev.eval_forward
    else:  # peak at a loss chunk: the final norm's output and one chunk's logits
        e["activations"] = inputs_eval + eb_tokens * C * d
        e["logits_loss"] = ev.eval_loss
    evaluation = {k: int(round(v)) for k, v in e.items()}

    # checkpoint save: resident state, plus (FSDP) the largest parameter gathered for the full state dict;
    # on the CPU the final state dict of FSDP lands on rank 0 as a full copy of the weights.
    s = _empty()
    s["parameters"] = params
    s["quantization"] = quant_state
    s["optimizer_state"] = optimizer
    s["gradients"] = buckets
    s["checkpoint"] = checkpoint_gather_bytes(spec)
    save = {k: int(round(v)) for k, v in s.items()}
    return {"train_step": train, "evaluation": evaluation, "checkpoint_save": save}


def checkpoint_gather_bytes(spec: Run) -> int:
    """What saving adds to a rank's resident state (both engines): under FSDP the root group (embedding, final norm,
    head) gathered (without cpu_offload; measured: LoRA pythia-160m, 2 processes, plan_accuracy.md), the full state
    dict gathering one parameter at a time (the largest), and on the CPU rank 0's whole gathered copy of the weights."""
    if not spec.parallel.fsdp:
        return 0
    counts = param_counts(spec.config)
    largest = max([counts.embed, counts.head] + [i * o for i, o, _ in counts.block_linear.values()])
    root = 0 if spec.parallel.cpu_offload else counts.embed + counts.head + counts.norm_f
    return (root + largest + (counts.total if spec.device_type == "cpu" else 0)) * spec.param_bytes


def host_checkpoint_bytes(spec: Run) -> int:
    """Host (CPU) memory the final checkpoint needs on rank 0 of a GPU run: a full copy of the weights."""
    return param_counts(spec.config).total * spec.param_bytes
