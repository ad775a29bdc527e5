"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat token batch.

Numerics follow transformers' implementation (same op order; residual adds in the model
dtype), so fp32 logits agree with it to rounding; in bf16/fp16 the fused RMSNorm rounds once
where transformers rounds twice (within one ulp). q/k/v and gate/up projections
are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvpilot.errors import ModelLoadError
from kvpilot.model.attention import AttentionBackend
from kvpilot.model.batch import StepBatch
from kvpilot.model.config import ModelConfig
from kvpilot.model.kv_cache import KVCache
from kvpilot.model.layer_ops import LayerOps, rms_norm
from kvpilot.model.rope import RopeTable


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [H + H_kv, d_head]: q_norm rows for q heads, then k_norm
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        ops: LayerOps | None = None,
    ) -> None:
        """``ops``: the layer ops this model will run with; they may repack linear weights."""
        self.config = config
        ops = ops or LayerOps()
        store = _WeightStore(weights, device, dtype)
        self.embed = store.take(
            "model.embed_tokens.weight", (config.vocab_size, config.hidden_size)
        )
        self.layers = tuple(
            _packed(_layer(store, config, i), ops) for i in range(config.num_layers)
        )
        self.final_norm = store.take("model.norm.weight", (config.hidden_size,))
        lm_head = store.take_optional("lm_head.weight", (config.vocab_size, config.hidden_size))
        if config.tie_word_embeddings or lm_head is None:
            if not config.tie_word_embeddings:
                raise ModelLoadError(
                    "checkpoint has no 'lm_head.weight' and does not tie embeddings"
                )
            lm_head = self.embed
        self.lm_head = ops.prepare_linear(lm_head)
        self.ops = ops
        self.windows = tuple(config.layer_window(i) for i in range(config.num_layers))
        self.rope = RopeTable(config, device, dtype, config.max_position_embeddings)

    def forward(
        self,
        batch: StepBatch,
        cache: KVCache,
        attention: AttentionBackend,
        window: tuple[StepBatch, KVCache] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm).

        ``window``: a hybrid model's sliding-window group (`kvpilot.model.window_group`): its
        layers attend over that batch and pool, the others over ``batch`` and ``cache``.
        """
        config = self.config
        n_tokens = batch.num_tokens
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        eps = config.rms_norm_eps
        ops = self.ops  # chosen with the attention backend at load time
        targets = self._targets(batch, cache, attention, window)
        rope = ops.rope_state(self.rope, batch.positions)
        residual = self.embed_tokens(batch.input_ids)
        delta: torch.Tensor | None = None  # the last MLP's output, not yet added
        for index, layer in enumerate(self.layers):
            x, residual = ops.add_rms_norm(delta, residual, layer.input_norm, eps)
            qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
            # q and k heads side by side: one norm and one rotation for both.
            qk = qkv[:, : q_size + kv_size].view(n_tokens, heads + kv_heads, head_dim)
            v = qkv[:, q_size + kv_size :].view(n_tokens, kv_heads, head_dim)
            if layer.qk_norm is not None:
                qk = rms_norm(qk, layer.qk_norm, eps)
            qk = ops.rope(qk, rope)
            local, kv_cache, kv_batch, state = targets[index]
            attended = attention.forward(
                local,
                qk[:, :heads],
                qk[:, heads:],
                v,
                kv_cache,
                kv_batch,
                state,
                self.windows[index],
            )
            out = self.reduce(
                ops.linear(attended.reshape(n_tokens, q_size), layer.o_proj, layer.o_bias)
            )
            x, residual = ops.add_rms_norm(out, residual, layer.post_norm, eps)
            gate_up = ops.linear(x, layer.gate_up, layer.gate_up_bias)
            delta = self.reduce(ops.linear(ops.silu_mul(gate_up), layer.down, layer.down_bias))
        return residual if delta is None else residual + delta

    def _targets(
        self,
        batch: StepBatch,
        cache: KVCache,
        attention: AttentionBackend,
        window: tuple[StepBatch, KVCache] | None,
    ) -> list[tuple[int, KVCache, StepBatch, object]]:
        """Per layer: its index in its pool, the pool, the batch and the backend's state."""
        if window is None:
            state = attention.prepare(batch, self.windows)
            return [(i, cache, batch, state) for i in range(len(self.layers))]
        window_batch, window_cache = window
        full = [w for w in self.windows if w is None]
        sliding = [w for w in self.windows if w is not None]
        full_state = attention.prepare(batch, full) if full else None
        window_state = attention.prepare(window_batch, sliding)
        targets: list[tuple[int, KVCache, StepBatch, object]] = []
        counts = [0, 0]
        for w in self.windows:
            if w is None:
                targets.append((counts[0], cache, batch, full_state))
                counts[0] += 1
            else:
                targets.append((counts[1], window_cache, window_batch, window_state))
                counts[1] += 1
        return targets

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] of the given rows of `forward`'s output."""
        normed = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return self.gather_vocab(self.ops.linear(normed, self.lm_head)).float()

    # Tensor parallelism overrides these three (`kvpilot.model.parallel.sharded_llama`).

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: here whole; under TP, summed over the ranks."""
        return partial

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (under TP, each rank computes a shard)."""
        return logits


class _WeightStore:
    """Checkpoint tensors by name, moved to the device and dtype as they are taken."""

    def __init__(
        self, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.tensors = dict(weights)
        self.device = device
        self.dtype = dtype

    def take_optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        tensor = self.tensors.pop(name, None)
        if tensor is None:
            return None
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, config.json implies {shape}"
            )
        return tensor.to(device=self.device, dtype=self.dtype)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.take_optional(name, shape)
        if tensor is None:
            raise ModelLoadError(f"checkpoint is missing weight {name!r}")
        return tensor

    def take_if(self, present: bool, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, shape) if present else None


def _packed(layer: LayerWeights, ops: LayerOps) -> LayerWeights:
    """The layer with its linear weights in the form ``ops.linear`` takes."""
    return replace(
        layer,
        qkv=ops.prepare_linear(layer.qkv),
        o_proj=ops.prepare_linear(layer.o_proj),
        gate_up=ops.prepare_linear(layer.gate_up),
        down=ops.prepare_linear(layer.down),
    )


def _fused(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    return torch.cat([p for p in parts if p is not None], dim=0)


def _qk_norm(store: _WeightStore, config: ModelConfig, attn: str) -> torch.Tensor | None:
    if not config.qk_norm:
        return None
    d = config.head_dim
    q_norm = store.take(attn + "q_norm.weight", (d,))
    k_norm = store.take(attn + "k_norm.weight", (d,))
    return torch.cat(
        [q_norm.expand(config.num_heads, d), k_norm.expand(config.num_kv_heads, d)]
    ).contiguous()


def _layer(store: _WeightStore, config: ModelConfig, i: int) -> LayerWeights:
    prefix = f"model.layers.{i}."
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    attn = prefix + "self_attn."
    mlp = prefix + "mlp."
    qkv_b = config.attention_bias
    mlp_b = config.mlp_bias
    return LayerWeights(
        input_norm=store.take(prefix + "input_layernorm.weight", (hidden,)),
        qkv=torch.cat(
            [
                store.take(attn + "q_proj.weight", (q_out, hidden)),
                store.take(attn + "k_proj.weight", (kv_out, hidden)),
                store.take(attn + "v_proj.weight", (kv_out, hidden)),
            ]
        ),
        qkv_bias=_fused(
            [
                store.take_if(qkv_b, attn + "q_proj.bias", (q_out,)),
                store.take_if(qkv_b, attn + "k_proj.bias", (kv_out,)),
                store.take_if(qkv_b, attn + "v_proj.bias", (kv_out,)),
            ]
        ),
        o_proj=store.take(attn + "o_proj.weight", (hidden, q_out)),
        o_bias=store.take_if(config.o_proj_bias, attn + "o_proj.bias", (hidden,)),
        qk_norm=_qk_norm(store, config, attn),
        post_norm=store.take(prefix + "post_attention_layernorm.weight", (hidden,)),
        gate_up=torch.cat(
            [
                store.take(mlp + "gate_proj.weight", (inter, hidden)),
                store.take(mlp + "up_proj.weight", (inter, hidden)),
            ]
        ),
        gate_up_bias=_fused(
            [
                store.take_if(mlp_b, mlp + "gate_proj.bias", (inter,)),
                store.take_if(mlp_b, mlp + "up_proj.bias", (inter,)),
            ]
        ),
        down=store.take(mlp + "down_proj.weight", (hidden, inter)),
        down_bias=store.take_if(mlp_b, mlp + "down_proj.bias", (hidden,)),
    )
