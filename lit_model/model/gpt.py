"""A GPT decoder that covers Llama, Mistral, Mixtral, GPT-NeoX/Pythia, Phi, Gemma (1, 2 and 3), Qwen2/Qwen3
(dense and MoE), OLMo 2 and SmolLM3.

Every architectural difference is a field of ``Config``; this file reads top to bottom: the model, a block,
attention, the MLPs, normalisation, rotary embeddings and the KV cache.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_model.model.contracts import ParamCounts, Saved, Step
from lit_model.core.config import Config
from lit_model.core.errors import STOPS, UserError
from lit_model.kernels.attention import attention, attention_dtype, softcap
from lit_model.kernels.ops import (ATTENTION_BLOCK, block_scores, cuda_attention_kernel, gated_product, linear,
                                   rms_norm, rotate, upcast_rms_norm)
from lit_model.kernels.policy import KernelPolicy, kernel_policy

# a layer built on its own (a test's, a bare MoE block) takes the CPU's kernels until a policy is handed in
CPU_KERNEL_POLICY = kernel_policy("cpu")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Within this block new floating-point tensors (a model's parameters) are made in ``dtype``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm_f = make_norm(config, config.n_embd)
        self.lm_head = Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # the CPU's until the code that places the model hands in its device's (set_kernel_policy)
        self.set_kernel_policy(kernel_policy("cpu"))
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._max_seq_length = config.block_size
        self.reset_rope_cache()

    def set_kernel_policy(self, policy: KernelPolicy) -> None:
        """The kernels every layer takes from now on (those that hold a ``kernel_policy``, LoRA's included)."""
        self.kernel_policy = policy
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, CausalSelfAttention)) or hasattr(module, "kernel_policy"):
                module.kernel_policy = policy

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        """Context the model runs with: at most the config's block size; smaller saves RoPE/mask memory."""
        if value > self.config.block_size:
            raise UserError(
                f"A sequence length of {value} is longer than {self.config.name or 'this model'} supports "
                f"(block_size={self.config.block_size}). Use a length of at most {self.config.block_size}."
            )
        self._max_seq_length = value
        self.reset_rope_cache()

    def reset_rope_cache(self, device: Optional[torch.device] = None) -> None:
        """(Re)build the cos/sin tables, e.g. after the model was created on the meta device. With a local RoPE
        base (Gemma 3) the global and the local tables sit side by side along the last dimension, so every
        caller indexes positions as usual and each attention layer takes its half."""
        device = device if device is not None else self.embed.weight.device
        cos, sin = rope_cache(self.config, self._max_seq_length, device)
        if self.config.rope_local_base is not None:
            local = replace(self.config, rope_base=self.config.rope_local_base, rope_scaling=None)
            cos_local, sin_local = rope_cache(local, self._max_seq_length, device)
            cos, sin = torch.cat((cos, cos_local), dim=-1), torch.cat((sin, sin_local), dim=-1)
        self.cos, self.sin = cos, sin

    def forward(
        self,
        idx: torch.Tensor,
        input_pos: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        readout: Optional[Callable[["GPT", torch.Tensor], Any]] = None,
    ) -> Any:
        """Logits of shape (batch, time, vocab); with ``readout`` what it makes of the model and the final hidden
        states (batch, time, embedding) instead: an objective's loss (methods/objective.py), which runs inside the
        forward so that whatever wraps the model (precision, FSDP's gathering) covers it too.

        ``input_pos`` (1-D, the positions of ``idx``'s tokens) switches to KV-cache decoding; see
        ``set_kv_cache``. ``positions`` (batch, time), for training on packed sequences: each token's RoPE
        position; a document starts where its position is 0 and attends only within itself.
        """
        T = idx.size(1)
        if input_pos is None:
            if T > self.max_seq_length:
                raise UserError(
                    f"Input of {T} tokens is longer than the model's max_seq_length={self.max_seq_length}. "
                    "Crop the input or raise max_seq_length (at most the config's block_size)."
                )
            if positions is None:
                cos, sin = self.cos[:T], self.sin[:T]
            else:  # per token: (B, 1, T, n_elem)
                cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        elif positions is not None:
            raise ValueError("positions (packed training) and input_pos (KV-cache decoding) exclude each other")
        else:
            cos, sin = self.cos.index_select(0, input_pos), self.sin.index_select(0, input_pos)

        x = self.embed(idx)
        masks = None
        if positions is not None:  # per-token tables and masks: made once in attention's dtype, not in every layer
            dtype = attention_dtype(x)
            cos, sin, masks = as_dtype(cos, dtype), as_dtype(sin, dtype), self.document_masks(positions, dtype)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, input_pos, None, masks)
        x = self.norm_f(x)
        return self.head(x) if readout is None else readout(self, x)

    def document_masks(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[Optional[int], torch.Tensor]:
        """The additive attention masks of packed sequences, per sliding window (None: no window), built once per
        forward and shared by every layer, in the dtype attention computes in so that no layer converts its own."""
        T = positions.size(1)
        windows = {self.config.sliding_window_size if self.config.layer_uses_sliding_window(i) else None
                   for i in range(self.config.n_layer)}
        full = document_mask(positions, None, dtype)
        return {w: full if w is None or w >= T else document_mask(positions, w, dtype) for w in windows}

    def head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        if self.config.final_logit_softcapping is not None:
            logits = softcap(logits, self.config.final_logit_softcapping)
        return logits

    # ---- generation --------------------------------------------------------------------------
    def set_kv_cache(
        self, batch_size: int, max_length: int, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None
    ) -> None:
        """Preallocate the cache for exactly ``max_length`` positions (prompt + new tokens)."""
        if max_length > self.max_seq_length:
            raise UserError(
                f"Prompt plus new tokens ({max_length}) exceed the model's context of {self.max_seq_length} "
                f"tokens. Ask for at most {self.max_seq_length} tokens in total."
            )
        device = device or self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        for block in self.blocks:
            block.attn.kv_cache = KVCache(batch_size, self.config, max_length, device, dtype)

    def clear_kv_cache(self) -> None:
        for block in self.blocks:
            block.attn.kv_cache = None

    # ---- weights ----------------------------------------------------------------------------
    @classmethod
    def on_meta(cls, config: Config) -> "GPT":
        """The model on the meta device: shapes and no memory. A stop signal meanwhile is raised once torch's device
        mode is popped (STOPS.held): raised inside the mode-stack swap it would leave that stack broken."""
        with STOPS.held(), torch.device("meta"):
            return cls(config)

    @classmethod
    def initialized(cls, config: Config, dtype: torch.dtype = torch.float32) -> "GPT":
        """A new model with ``init_weights``'s weights, stored in ``dtype`` on the CPU. Built on the meta device,
        then filled: the process holds the model once, in ``dtype`` (not a default-initialised fp32 copy with an
        untied head first, as ``GPT(config)`` makes: 2.8 GB for Qwen2.5-0.5B, whose bf16 weights are 0.9 GB)."""
        with default_dtype(dtype):
            model = cls.on_meta(config)
        model.to_empty(device="cpu")
        if config.tie_embeddings:  # to_empty may give the two modules separate tensors
            model.lm_head.weight = model.embed.weight
        model.reset_rope_cache()
        model.init_weights()
        return model

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual output projections scaled down by depth. The values are drawn in
        fp32 (for a 16-bit model a block of rows at a time) and rounded to the weights' dtype."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                _normal_in_fp32(module.weight, std=residual_std if name.endswith(".proj") else 0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.reset_parameters()

    # ---- memory contract (model/contracts.py) ------------------------------------------------
    @classmethod
    def memory_contract(cls, config: Config) -> ParamCounts:
        """The element counts of the model's parts (tied weights counted once)."""
        C, V = config.n_embd, config.padded_vocab_size
        return ParamCounts(
            embed=TORCH_CONTRACTS[nn.Embedding].memory_contract(V, C),
            head=0 if config.tie_embeddings else Linear.memory_contract(C, V, config.lm_head_bias),
            norm_f=sum(norm_contract(config).parameter_sizes(C)), block_linear=Block.linear_shapes(config),
            block_norm_sizes=Block.norm_sizes(config), n_layer=config.n_layer,
        )

    @staticmethod
    def buffer_bytes(config: Config, seq_len: int) -> int:
        """cos/sin in fp32 for ``max_seq_length = seq_len`` (with a local base: the global and local tables)."""
        return 2 * seq_len * config.rope_n_elem * 4 * (1 if config.rope_local_base is None else 2)


class Block(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.norm_1 = make_norm(config, config.n_embd) if config.pre_norm else nn.Identity()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.post_attention_norm = make_norm(config, config.n_embd) if config.post_attention_norm else nn.Identity()
        if config.shared_attention_norm:
            self.norm_2 = None
        else:
            self.norm_2 = make_norm(config, config.n_embd) if config.pre_norm else nn.Identity()
        self.mlp = MLP_CLASSES[config.mlp_class_name](config)
        self.post_mlp_norm = make_norm(config, config.n_embd) if config.post_mlp_norm else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
                input_pos_maxp1: Optional[int] = None,
                document_masks: Optional[dict[Optional[int], torch.Tensor]] = None) -> torch.Tensor:
        x_normed = self.norm_1(x)
        attention_output = self.post_attention_norm(self.attn(x_normed, cos, sin, input_pos, input_pos_maxp1,
                                                              document_masks))
        if self.config.parallel_residual:
            mlp_input = x_normed if self.norm_2 is None else self.norm_2(x)
            return x + attention_output + self.post_mlp_norm(self.mlp(mlp_input))
        x = x + attention_output
        return x + self.post_mlp_norm(self.mlp(self.norm_2(x)))

    # ---- memory contract (model/contracts.py) ------------------------------------------------
    @classmethod
    def linear_shapes(cls, config: Config) -> dict[str, tuple[int, int, bool]]:
        """(in, out, bias) of every linear layer, by its name relative to the block."""
        attention = {f"attn.{name}": shape for name, shape in CausalSelfAttention.linear_shapes(config).items()}
        mlp = {f"mlp.{name}": shape for name, shape in MLP_CLASSES[config.mlp_class_name].linear_shapes(config).items()}
        return {**attention, **mlp}

    @classmethod
    def norm_sizes(cls, config: Config) -> list[int]:
        """Element counts of the norms' weights (and biases)."""
        pre_norms = (1 + (0 if config.shared_attention_norm else 1)) if config.pre_norm else 0
        norms = pre_norms + int(config.post_attention_norm) + int(config.post_mlp_norm)
        return norm_contract(config).parameter_sizes(config.n_embd) * norms + CausalSelfAttention.norm_sizes(config)

    @classmethod
    def memory_contract(cls, config: Config, step: Step, layer: int, x_rg: bool, trains: bool, attention: type,
                        branch: Optional[Callable[..., float]]) -> Saved:
        """Bytes block ``layer`` keeps for backward given whether its input requires grad (``x_rg``) and its weights
        train, with ``attention`` its attention class and ``branch`` the contract of the LoRA branches on its
        linears (``step.lora_names``). Its input is in the parameters' dtype, matmul outputs in the compute dtype."""
        d, dm = step.param_bytes, step.compute_bytes
        C, I = config.n_embd, config.intermediate_size
        norm = norm_contract(config)
        linears = BlockLinears(step, trains, branch)
        kept, xn_rg = norm.memory_contract(config, step, d, x_rg, trains, C) if config.pre_norm else (0.0, x_rg)
        attn = attention.memory_contract(config, step, layer, xn_rg, linears)
        per_token = kept + attn.per_token
        a_rg = attn.out_requires_grad
        if config.post_attention_norm:
            kept, a_rg = norm.memory_contract(config, step, dm, a_rg, trains, C)
            per_token += kept
        per_token += attn.input_per_token
        # MLP input
        if config.parallel_residual:
            if config.shared_attention_norm:
                m_in_rg = xn_rg
                shared_with_attention = True
            else:
                shared = config.norm_class_name == "LayerNorm" and x_rg  # norm_1 already keeps x
                kept, m_in_rg = norm.memory_contract(config, step, d, x_rg, trains, C, shared_input=shared)
                per_token += kept
                shared_with_attention = False
            res_rg = x_rg or a_rg
        else:
            x2_rg = x_rg or a_rg
            kept, m_in_rg = norm.memory_contract(config, step, d, x2_rg, trains, C) if config.pre_norm else (0.0, x2_rg)
            per_token += kept
            shared_with_attention = False
            res_rg = x2_rg
        before_mlp = per_token
        # the MLP reads the attention's input: kept once, unless autocast casts it for each linear
        input_kept = shared_with_attention and not step.autocast and bool(attn.input_per_token)
        mlp = MLP_CLASSES[config.mlp_class_name].memory_contract(config, step, m_in_rg, linears, input_kept)
        per_token += mlp.per_token
        m_rg = mlp.out_requires_grad
        # measured: about one intermediate-sized gradient beyond what is freed
        transient = max((I + C) * dm + attn.transient_per_token, attn.transient_floor)
        # selective checkpointing (activations.SAVED_OPS): the block's input and every matmul and attention output,
        # the LoRA branches' two matmuls (MoE: the whole block's kept tensors, an upper bound)
        selective = C * d + 2 * C * dm + attn.selective_per_token + mlp.selective_per_token
        selective += sum((step.lora_r + out) * dm for name, (_, out, _) in cls.linear_shapes(config).items()
                         if name in step.lora_names)
        if config.mlp_class_name == "LLaMAMoE":
            selective = per_token + C * d
        if step.mlp_tiles > 1:
            # activations.tiled: the MLP keeps only its input (in its tiles' checkpoints); in backward one tile at a
            # time recomputes its activations
            transient += (per_token - before_mlp) / step.mlp_tiles
            per_token = before_mlp + C * d
        if config.post_mlp_norm:
            kept, m_rg = norm.memory_contract(config, step, dm, m_rg, trains, C)
            per_token += kept
        return Saved(per_token, attn.per_sample_t2, attn.per_layer, res_rg or m_rg, transient,
                     selective_per_token=selective)


class CausalSelfAttention(nn.Module):
    kernel_policy: KernelPolicy = CPU_KERNEL_POLICY  # GPT.set_kernel_policy hands in the run's

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        qkv_bias = config.bias or config.attn_bias
        self.query = Linear(config.n_embd, config.n_head * config.head_size, bias=qkv_bias)
        self.key = Linear(config.n_embd, config.n_query_groups * config.head_size, bias=qkv_bias)
        self.value = Linear(config.n_embd, config.n_query_groups * config.head_size, bias=qkv_bias)
        self.proj = Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        if config.qk_norm is not None:
            per_head = config.qk_norm == "head"
            self.q_norm = make_norm(config, config.head_size if per_head else config.n_head * config.head_size)
            self.k_norm = make_norm(config, config.head_size if per_head else config.n_query_groups * config.head_size)
        self.sliding_window = config.sliding_window_size if config.layer_uses_sliding_window(layer_idx) else None
        self.use_rope = config.layer_uses_rope(layer_idx)
        self.scale = 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
                input_pos_maxp1: Optional[int] = None,
                document_masks: Optional[dict[Optional[int], torch.Tensor]] = None) -> torch.Tensor:
        """``input_pos_maxp1`` (decoding only): ``max(input_pos) + 1``, known on the host, for ``input_pos`` that
        is a contiguous range. Attention then reads only the cache positions written so far, and needs no mask
        where causality follows from the shapes (one query, or a prefill that starts at position 0).
        ``document_masks`` (packed training, see ``GPT.document_masks``): the mask for each sliding window."""
        B, T, _ = x.shape
        hs, n_head, n_kv = self.config.head_size, self.config.n_head, self.config.n_query_groups
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.config.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(B, T, n_head, hs), k.view(B, T, n_kv, hs), v.view(B, T, n_kv, hs)
        if self.config.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        # (B, heads, T, head_size)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.use_rope:
            n_elem = self.config.rope_n_elem
            if self.config.rope_local_base is not None:  # global and local tables side by side (reset_rope_cache)
                columns = slice(n_elem, 2 * n_elem) if self.sliding_window is not None else slice(0, n_elem)
                cos, sin = cos[..., columns], sin[..., columns]
            q = apply_rope(q, cos, sin, n_elem)
            k = apply_rope(k, cos, sin, n_elem)

        if input_pos is not None:
            if self.kv_cache is None:
                raise RuntimeError("Call `model.set_kv_cache(...)` before decoding with input_pos.")
            k, v, mask = self.kv_cache.update(input_pos, k, v, input_pos_maxp1, self.sliding_window)
            k, v = as_dtype(k, q.dtype), as_dtype(v, q.dtype)
        elif document_masks is not None:
            mask = document_masks[self.sliding_window]
        elif self.sliding_window is not None and T > self.sliding_window:
            mask = attention_mask(torch.arange(T, device=x.device), T, self.sliding_window)
        else:
            mask = None  # plain causal

        return self.proj(self.attend(q, k, v, mask).reshape(B, T, n_head * hs))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, T, heads, head_size): ``kernels.attention`` (an adapter adds its prefix's attention here)."""
        return attention(q, k, v, mask, self.scale, self.config.attention_logit_softcapping, self.config.n_embd,
                         self.kernel_policy)

    # ---- memory contract (model/contracts.py) ------------------------------------------------
    @classmethod
    def linear_shapes(cls, config: Config) -> dict[str, tuple[int, int, bool]]:
        C, hs, qkv_bias = config.n_embd, config.head_size, config.bias or config.attn_bias
        return {"query": (C, config.n_head * hs, qkv_bias), "key": (C, config.n_query_groups * hs, qkv_bias),
                "value": (C, config.n_query_groups * hs, qkv_bias), "proj": (config.n_head * hs, C, config.bias)}

    @classmethod
    def norm_sizes(cls, config: Config) -> list[int]:
        """The q/k norms' weights (and biases)."""
        norm, hs = norm_contract(config), config.head_size
        if config.qk_norm == "head":
            return norm.parameter_sizes(hs) * 2
        if config.qk_norm == "projection":
            return norm.parameter_sizes(config.n_head * hs) + norm.parameter_sizes(config.n_query_groups * hs)
        return []

    @classmethod
    def memory_contract(cls, config: Config, step: Step, layer: int, x_rg: bool, linears: BlockLinears) -> Saved:
        """The q, k, v projections, their norms, attention (``attend_contract``) and the output projection; the input
        they share is ``input_per_token``."""
        d, dm, T, C = step.param_bytes, step.compute_bytes, step.seq_len, config.n_embd
        hs = config.head_size
        Hq, Hkv = config.n_head * hs, config.n_query_groups * hs
        per_token = 0.0
        out_rg = {}
        for name, out in (("query", Hq), ("key", Hkv), ("value", Hkv)):
            kept, branch_rg = linears.branch_kept(f"attn.{name}", C, out, x_rg)
            per_token += kept
            out_rg[name] = x_rg or linears.trains or branch_rg
        if config.qk_norm is not None:  # RMSNorm of the query and key projections (per head, or as a whole)
            norm = norm_contract(config)
            for name, heads in (("query", config.n_head), ("key", config.n_query_groups)):
                rows = heads if config.qk_norm == "head" else 1
                kept, out_rg[name] = norm.memory_contract(config, step, dm, out_rg[name], linears.trains, heads * hs,
                                                          rows=rows)
                per_token += kept
        core = cls.attend_contract(config, step, layer, any(out_rg.values()))
        per_token += core.per_token
        per_layer = core.per_layer
        if dm != 4 and config.rope_n_elem and config.layer_uses_rope(layer):
            # apply_rope casts cos/sin to the compute dtype for q and for k; the products keep the casts
            per_layer += 2 * T * config.rope_n_elem * dm * (int(out_rg["query"]) + int(out_rg["key"]))
        y_rg = core.out_requires_grad
        partial_rope = 0 < config.rope_n_elem < hs  # rope's cat makes q contiguous in (B, H, T, hs) ...
        y_copy = partial_rope or config.attention_logit_softcapping is not None  # ... so the output reshape copies
        # output projection: keeps its input (the attention output, or its reshaped copy)
        if linears.keeps_input("attn.proj") and (y_copy or not y_rg):
            per_token += Hq * dm
        kept, branch_rg = linears.branch_kept("attn.proj", Hq, C, y_rg)
        per_token += kept
        return Saved(per_token, core.per_sample_t2, per_layer, y_rg or linears.trains or branch_rg,
                     core.transient_per_token, core.transient_floor, core.selective_per_token,
                     input_per_token=linears.shared_input(("attn.query", "attn.key", "attn.value"), C, d))

    @classmethod
    def attend_contract(cls, config: Config, step: Step, layer: int, qkv_rg: bool) -> Saved:
        """``attend``: rope makes new q/k tensors (nothing kept); attention keeps q, k, v and its output, as the
        kernel the device's policy picks keeps them."""
        dm, T, C, hs = step.compute_bytes, step.seq_len, config.n_embd, config.head_size
        Hq, Hkv = config.n_head * hs, config.n_query_groups * hs
        sliding = config.layer_uses_sliding_window(layer) and T > (config.sliding_window_size or 0)
        masked = sliding or step.packing
        # k and v as attention takes them: copied to every query head where kernels.attention does (CUDA, else math)
        policy = kernel_policy(step.device_type)
        Hkv_attended = Hq if Hkv < Hq and policy.expands_shared_heads(step.attention_dtype, hs, masked, T) else Hkv
        softcapped = config.attention_logit_softcapping is not None
        in_blocks = (qkv_rg and not masked and T > 1 and not softcapped
                     and policy.attends_in_blocks(step.attention_dtype, step.batch, config.n_head, T, C))
        attention_math = qkv_rg and step.device_type == "cuda" and cuda_attention_kernel(
            step.attention_dtype, hs, masked, Hkv_attended < Hq) == "math"
        per_token, t2, per_layer = 0.0, 0.0, 0.0
        if softcapped:
            if qkv_rg:
                # q, k and v (repeated to every query head when grouped) kept by the two matmuls
                per_token += Hq * dm + 2 * (Hq if Hkv < Hq else Hkv) * dm
                # per sample: tanh output, fp32 softmax output, probabilities cast back to the compute dtype
                t2 += config.n_head * T * T * (dm + 4 + (dm if dm != 4 else 0))
                per_layer += T * T  # the inverted boolean mask kept by masked_fill
        elif attention_math:
            # CUDA's math kernel: the scaled q, k and v repeated to every query head, the output, the probabilities
            per_token += 4 * Hq * dm
            t2 += config.n_head * T * T * dm
            if sliding:
                per_layer += T * T * dm
        elif in_blocks:
            # attention in blocks (ops.py): q, k and v (copied to every query head), the output, the probabilities
            per_token += 4 * Hq * dm
            t2 += config.n_head * block_scores(T) * dm
        elif qkv_rg:
            per_token += (Hq + 2 * Hkv_attended) * dm + Hq * dm + config.n_head * 4  # q, k, v, output, logsumexp
            if sliding:
                per_layer += T * T * dm  # the explicit mask (converted to the compute dtype), kept by SDPA
            elif policy.attends_in_halves(T):
                per_layer += (T - T // 2) * T * dm  # attention in halves (ops.py): the second half's mask, converted
        # the probabilities' gradient and the softmax's, per token
        transient = 2 * config.n_head * T * dm if attention_math and not softcapped else 0.0
        # in blocks: the largest block's score gradients (the bf16 product, its fp32 copy, the bf16 cast: 6 bytes a
        # score) are in flight instead of (not on top of) the MLP's (the trace: 0.998-1.04x)
        floor = 6 * config.n_head * min(T, ATTENTION_BLOCK) if in_blocks else 0.0
        selective = (2 * Hq + 2 * Hkv) * dm + config.n_head * 4  # q, k, v, the output and its logsumexp
        return Saved(per_token, t2, per_layer, qkv_rg, transient, floor, selective)


def attention_mask(input_pos: torch.Tensor, key_length: int, sliding_window: Optional[int]) -> torch.Tensor:
    """Boolean mask: query at position p sees keys at positions <= p (and > p - window). (T, key_length) for
    positions (T,) shared by the batch; (B, 1, T, key_length) for each row's own positions (B, T)."""
    key_pos = torch.arange(key_length, device=input_pos.device)
    query_pos = input_pos[..., None]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask if input_pos.ndim == 1 else mask.unsqueeze(1)


def document_mask(positions: torch.Tensor, sliding_window: Optional[int], dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, T, T) mask of packed sequences (0: attend, -inf: not): a token sees the earlier tokens of
    its own document (and within the last ``sliding_window``); a document starts where ``positions`` is 0."""
    T = positions.size(1)
    documents = (positions == 0).cumsum(dim=1)
    index = torch.arange(T, device=positions.device)
    visible = (documents[:, :, None] == documents[:, None, :]) & (index[None, :] <= index[:, None])
    if sliding_window is not None:
        visible &= index[None, :] > index[:, None] - sliding_window
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
    return mask.unsqueeze(1)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose product takes ``ops.linear``'s kernel choice."""

    kernel_policy: KernelPolicy = CPU_KERNEL_POLICY  # GPT.set_kernel_policy hands in the run's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel_policy.onednn_fp32_linear)

    @staticmethod
    def memory_contract(in_features: int, out_features: int, bias: bool) -> int:
        """Parameter elements (what it keeps for backward depends on its neighbours: ``BlockLinears``)."""
        return in_features * out_features + (out_features if bias else 0)


def plain_linear(module: nn.Module) -> bool:
    """A linear layer as the model builds it (or a bare ``nn.Linear``): not quantized, not adapted."""
    return type(module) in (nn.Linear, Linear)


class GptNeoxMLP(nn.Module):
    """Linear -> GELU -> Linear (GPT-NeoX, Phi)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc = Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))

    @classmethod
    def linear_shapes(cls, config: Config) -> dict[str, tuple[int, int, bool]]:
        C, I = config.n_embd, config.intermediate_size
        return {"fc": (C, I, config.bias), "proj": (I, C, config.bias)}

    @classmethod
    def memory_contract(cls, config: Config, step: Step, x_rg: bool, linears: BlockLinears, input_kept: bool) -> Saved:
        """``input_kept``: its input is already kept by the attention that reads it too."""
        d, dm, C, I = step.param_bytes, step.compute_bytes, config.n_embd, config.intermediate_size
        per_token, branch_rg = linears.branch_kept("mlp.fc", C, I, x_rg)
        h_rg = x_rg or linears.trains or branch_rg
        if h_rg:
            per_token += I * dm  # gelu input
        if linears.keeps_input("mlp.proj"):
            per_token += I * dm  # gelu output kept by proj
        kept, branch_rg = linears.branch_kept("mlp.proj", I, C, h_rg)
        per_token += kept
        if not input_kept:
            per_token += linears.shared_input(("mlp.fc",), C, d)
        return Saved(per_token, out_requires_grad=h_rg or linears.trains or branch_rg, selective_per_token=I * dm)


class LLaMAMLP(nn.Module):
    """SwiGLU: proj(silu(fc_1(x)) * fc_2(x)) (Llama, Mistral, Qwen, Phi-3)."""

    def __init__(self, config: Config, linear_class: type[nn.Linear] = Linear) -> None:
        super().__init__()
        self.fc_1 = linear_class(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = linear_class(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = linear_class(config.intermediate_size, config.n_embd, bias=config.bias)

    approximate: Optional[str] = None  # the gate's activation: SiLU (GemmaMLP: GELU, exact or tanh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(gated_product(self.fc_1(x), self.fc_2(x), self.approximate))

    @classmethod
    def linear_shapes(cls, config: Config) -> dict[str, tuple[int, int, bool]]:
        C, I = config.n_embd, config.intermediate_size
        return {"fc_1": (C, I, config.bias), "fc_2": (C, I, config.bias), "proj": (I, C, config.bias)}

    @classmethod
    def memory_contract(cls, config: Config, step: Step, x_rg: bool, linears: BlockLinears, input_kept: bool) -> Saved:
        """``input_kept``: its input is already kept by the attention that reads it too."""
        d, dm, C, I = step.param_bytes, step.compute_bytes, config.n_embd, config.intermediate_size
        names = ("mlp.fc_1", "mlp.fc_2")
        per_token = 0.0
        h_rg = {name: x_rg for name in names}
        for name in names:
            kept, branch_rg = linears.branch_kept(name, C, I, x_rg)
            per_token += kept
            h_rg[name] = h_rg[name] or linears.trains or branch_rg
        s_rg, h2_rg = h_rg["mlp.fc_1"], h_rg["mlp.fc_2"]
        if s_rg or h2_rg:
            per_token += 2 * I * dm  # the gate's inputs, kept by the gated product (kernels/ops.gated_product)
        p_rg = s_rg or h2_rg
        if linears.keeps_input("mlp.proj"):
            per_token += I * dm  # product kept by proj
        kept, branch_rg = linears.branch_kept("mlp.proj", I, C, p_rg)
        per_token += kept
        if not input_kept:
            per_token += linears.shared_input(names, C, d)
        return Saved(per_token, out_requires_grad=p_rg or linears.trains or branch_rg, selective_per_token=2 * I * dm)


class GemmaMLP(LLaMAMLP):
    """GeGLU: the gate goes through GELU instead of SiLU (Gemma)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.approximate = config.gelu_approximate


@torch.library.custom_op("lit_model::expert_tokens", mutates_args=())
def expert_tokens(chosen: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that chose ``expert`` (rows of ``chosen``, tokens x k) and in which of their k slots."""
    pairs = (chosen == expert).nonzero()
    return pairs[:, 0].clone(), pairs[:, 1].clone()  # a custom op's outputs may not alias each other


@expert_tokens.register_fake
def _expert_tokens_fake(chosen: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, k = chosen.shape
    try:  # torch.compile: a data-dependent size
        rows = torch.library.get_ctx().new_dynamic_size(max=tokens)
    except torch._subclasses.fake_tensor.DynamicOutputShapeException:
        # Fake tensors without a shape environment (the memory planner's trace) carry no routing: the routing that
        # needs the most memory, every token choosing experts 0..k-1 (the experts' saved activations add up to k
        # rows per token whatever the choice; the buffers in flight in one expert's forward and backward grow with
        # its rows, at most one per token).
        rows = tokens if expert < k else 0
    return chosen.new_empty((rows,), dtype=torch.long), chosen.new_empty((rows,), dtype=torch.long)


class LLaMAMoE(nn.Module):
    """Mixture of SwiGLU experts (Mixtral, Qwen3-MoE): a router scores every expert per token, the
    ``n_expert_per_token`` best run on that token and their outputs are summed, weighted by the router's softmax
    probabilities (renormalised over the chosen experts with ``moe_norm_topk``)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate = Linear(config.n_embd, config.n_expert, bias=False)
        # An expert sees a new number of tokens every step, and oneDNN builds and caches a kernel for each shape (the
        # process grows step by step: benchmarks/results/moe_plan.md): the experts keep PyTorch's own linear maps.
        self.experts = nn.ModuleList(LLaMAMLP(config, linear_class=nn.Linear) for _ in range(config.n_expert))
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.config.n_expert_per_token, dim=-1)  # (tokens, k)
        if self.config.moe_norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = expert_tokens(chosen, e)
            y = y.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return y.view(B, T, C)

    @classmethod
    def linear_shapes(cls, config: Config) -> dict[str, tuple[int, int, bool]]:
        experts = LLaMAMLP.linear_shapes(config)
        return {"gate": (config.n_embd, config.n_expert, False),
                **{f"experts.{e}.{name}": shape for e in range(config.n_expert) for name, shape in experts.items()}}

    @classmethod
    def memory_contract(cls, config: Config, step: Step, x_rg: bool, linears: BlockLinears, input_kept: bool) -> Saved:
        """Each token runs an expert's SwiGLU in k experts, on its own copy of the input; per choice also the expert's
        output (kept by the product with the router weight), that weight, the int64 top-k index and the token and
        slot indices of the dispatch, the fp32 top-k probability. The router keeps its fp32 softmax, the sum that
        renormalises the top k, and its input when its weight trains. (Equal to the trace, which routes every token
        to experts 0..k-1: the most memory any routing needs, expert_tokens.)"""
        d, dm, C = step.param_bytes, step.compute_bytes, config.n_embd
        expert = LLaMAMLP.memory_contract(config, step, x_rg, linears, input_kept)
        per_choice = expert.per_token + C * d + C * dm + 3 * 8 + 4 + d
        router = config.n_expert * 4 + 4 * config.moe_norm_topk + C * dm * linears.trains
        return replace(expert, per_token=config.n_expert_per_token * per_choice + router)


MLP_CLASSES = {"GptNeoxMLP": GptNeoxMLP, "LLaMAMLP": LLaMAMLP, "GemmaMLP": GemmaMLP, "LLaMAMoE": LLaMAMoE}


INIT_DRAW_ELEMENTS = 1 << 22  # fp32 values drawn at once for a 16-bit weight (16 MB)


def _normal_in_fp32(weight: torch.Tensor, std: float) -> None:
    """N(0, std) drawn in fp32 and rounded to ``weight``'s dtype, at most INIT_DRAW_ELEMENTS at a time."""
    if weight.dtype == torch.float32:
        nn.init.normal_(weight, mean=0.0, std=std)
        return
    rows = weight.view(weight.size(0), -1)
    step = max(1, INIT_DRAW_ELEMENTS // max(rows.size(1), 1))
    for start in range(0, rows.size(0), step):
        block = rows[start : start + step]
        block.copy_(torch.empty(block.shape, dtype=torch.float32, device=block.device).normal_(0.0, std))


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32; Gemma scales by (1 + weight)."""

    kernel_policy: KernelPolicy = CPU_KERNEL_POLICY  # GPT.set_kernel_policy hands in the run's

    def __init__(self, size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and not self.unit_offset:
            return rms_norm(x, self.weight, self.eps, self.kernel_policy.norms_by_hand(x.numel()))
        return upcast_rms_norm(x, self.weight, self.eps, self.unit_offset)

    @classmethod
    def parameter_sizes(cls, size: int) -> list[int]:
        return [size]

    @classmethod
    def memory_contract(cls, config: Config, step: Step, d: int, x_rg: bool, w_train: bool, C: int,
                        shared_input: bool = False, rows: int = 1) -> tuple[float, bool]:
        """Kept bytes per token of a norm over C channels of ``d`` bytes (in ``rows`` groups normalised on their own:
        the heads of a per-head q/k norm), and whether its output requires grad."""
        if not (x_rg or w_train):
            return 0.0, False
        if not config.norm_unit_offset and kernel_policy(step.device_type).norms_by_hand(step.norm_tokens * C):
            return d * C, True  # input and weight of one dtype: ops.rms_norm's own path keeps only its input
        kept = 0.0
        if x_rg:
            kept += 4 * C + 4 * rows  # the fp32 input (x itself in fp32) and rsqrt
        if w_train:
            kept += 4 * C if config.norm_unit_offset else d * C  # normalised activations for the weight gradient
        return kept, True


def make_norm(config: Config, size: int) -> nn.Module:
    if config.norm_class_name == "LayerNorm":
        return nn.LayerNorm(size, eps=config.norm_eps)
    return RMSNorm(size, eps=config.norm_eps, unit_offset=config.norm_unit_offset)


def rope_cache(config: Config, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, rope_n_elem) in fp32, with Llama 3.1 frequency scaling."""
    n_elem = config.rope_n_elem
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem))
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("rope_type", "llama3") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > original / low, inv_freq / factor, torch.where(wavelen < original / high, inv_freq, smoothed)
        )
    elif scaling is not None and scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq).repeat(1, 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_elem: int) -> torch.Tensor:
    """Rotate the first ``n_elem`` channels of each head (the "rotate half" convention of HF weights)."""
    if n_elem == 0:
        return x
    partial = n_elem < x.size(-1)
    rotated = rotate(x[..., :n_elem] if partial else x, as_dtype(cos, x.dtype), as_dtype(sin, x.dtype))
    return torch.cat((rotated, x[..., n_elem:]), dim=-1) if partial else rotated


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipping the call where it would return ``x`` itself: a decoding step runs dozens of
    these, and each call costs about a microsecond of dispatch."""
    return x if x.dtype == dtype else x.to(dtype)


class KVCache(nn.Module):
    """Keys and values for ``max_length`` positions, written in place at ``input_pos``."""

    def __init__(self, batch_size: int, config: Config, max_length: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (batch_size, config.n_query_groups, max_length, config.head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos_maxp1: Optional[int],
               sliding_window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Write ``k``, ``v`` (B, key heads, T, head_size) at positions ``input_pos`` (T,); return the keys and values
        attention reads and its mask. The interface of every cache (``infer/paged.py``'s too): how a cache stores
        its positions is its own business, so the attention layer does not change with it."""
        self.k.index_copy_(2, input_pos, as_dtype(k, self.k.dtype))
        self.v.index_copy_(2, input_pos, as_dtype(v, self.v.dtype))
        if input_pos_maxp1 is None:
            return self.k, self.v, attention_mask(input_pos, self.k.size(2), sliding_window)
        windowed = sliding_window is not None and input_pos_maxp1 > sliding_window
        needs_mask = windowed or k.size(2) not in (1, input_pos_maxp1)
        mask = attention_mask(input_pos, input_pos_maxp1, sliding_window) if needs_mask else None
        return self.k[:, :, :input_pos_maxp1], self.v[:, :, :input_pos_maxp1], mask


# ---- memory contracts of the layers' shared parts and of torch's own classes (model/contracts.py) ---------------
@dataclass(frozen=True)
class BlockLinears:
    """What decides the bytes the linear layers of one block keep: whether their weights train, and which carry a
    LoRA branch (``step.lora_names``) with its contract ``branch`` (methods/lora.py: the model cannot import it)."""

    step: Step
    trains: bool
    branch: Optional[Callable[..., float]]

    def adapted(self, name: str) -> bool:
        return name in self.step.lora_names

    def keeps_input(self, name: str) -> bool:
        """Whether linear ``name`` keeps its input: a trainable weight, or a LoRA branch that does (``Step``)."""
        return self.trains or (self.adapted(name) and self.step.lora_keeps_input)

    def branch_kept(self, name: str, in_dim: int, out_dim: int, in_rg: bool) -> tuple[float, bool]:
        """Kept bytes of linear ``name``'s LoRA branch; whether it makes the output require grad."""
        if not self.adapted(name):
            return 0.0, False
        return self.branch(self.step, in_dim, out_dim, in_rg), True

    def shared_input(self, names: tuple[str, ...], in_dim: int, in_bytes: int) -> float:
        """The input shared by linears ``names``: kept once; under autocast one cast per keeping linear."""
        step, dm = self.step, self.step.compute_bytes
        plain_branches = step.lora_keeps_input and not step.autocast
        if not (self.trains or (plain_branches and any(self.adapted(name) for name in names))):
            return 0.0
        if step.autocast and in_bytes != dm:
            return (len(names) if self.trains else 0) * in_dim * dm
        return in_dim * in_bytes


class _LayerNormContract:
    """nn.LayerNorm: a weight and a bias; keeps its input, mean and rstd (fp32) for backward."""

    @staticmethod
    def parameter_sizes(size: int) -> list[int]:
        return [size, size]

    @staticmethod
    def memory_contract(config: Config, step: Step, d: int, x_rg: bool, w_train: bool, C: int,
                        shared_input: bool = False, rows: int = 1) -> tuple[float, bool]:
        if not (x_rg or w_train):
            return 0.0, False
        return (0 if shared_input else d * C) + 8 * rows, True


class _EmbeddingContract:
    """nn.Embedding: a (num, dim) weight; keeps only the int64 indices, which the batch holds anyway."""

    @staticmethod
    def memory_contract(num_embeddings: int, embedding_dim: int) -> int:
        return num_embeddings * embedding_dim


class _HoldsNothing:
    """Containers and no-ops (nn.ModuleList, nn.Identity) and LoRA's dropout, which the LoRA branch's contract
    counts: nothing of their own."""

    @staticmethod
    def memory_contract() -> int:
        return 0


TORCH_CONTRACTS: dict[type, Any] = {
    nn.Linear: Linear,  # the same parameters; a bare nn.Linear (the experts') keeps what Linear keeps
    nn.LayerNorm: _LayerNormContract,
    nn.Embedding: _EmbeddingContract,
    nn.ModuleList: _HoldsNothing,
    nn.Identity: _HoldsNothing,
    nn.Dropout: _HoldsNothing,
}


def contract_of(cls: type) -> Any:
    """Where module class ``cls`` publishes its memory contract: itself, or (torch's classes) ``TORCH_CONTRACTS``."""
    return TORCH_CONTRACTS[cls] if cls in TORCH_CONTRACTS else cls if hasattr(cls, "memory_contract") else None


def norm_contract(config: Config) -> Any:
    """The contract of the norm class ``make_norm`` builds for ``config``."""
    return contract_of(nn.LayerNorm if config.norm_class_name == "LayerNorm" else RMSNorm)
