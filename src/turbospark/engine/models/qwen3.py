"""Qwen3 (model_type "qwen3"): Llama's shape plus RMSNorm on each q and k head before rotary,
and head_dim taken from the config (it need not be hidden_size / num_heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turbospark.engine.layers import RMSNorm
from turbospark.engine.models import base


@dataclass(slots=True)
class ModelConfig(base.BaseConfig):
    attention_bias: bool = False
    use_sliding_window: bool = False

    def validate(self) -> None:
        if self.use_sliding_window:
            raise ValueError("qwen3 with use_sliding_window is not supported")
        base.BaseConfig.validate(self)


class Attention(base.Attention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def rotate_qk(
        self, qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.ops.rotary(self.q_norm(qk[:, : self.num_heads]), *rope)
        k = self.ops.rotary(self.k_norm(qk[:, self.num_heads :]), *rope)
        return q, k


MLP = base.MLP


class DecoderLayer(base.DecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, Attention(config), MLP(config))


class CausalLM(base.CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions, DecoderLayer)
