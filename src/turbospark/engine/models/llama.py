"""Llama (model_type "llama"): Llama 2/3/3.1+ (llama3 rope scaling), SmolLM/SmolLM2.

The shared decoder (fused q/k/v and gate/up, tied lm_head when the config says so) is in
`base`; Llama adds the optional biases of its config.
"""

from __future__ import annotations

from dataclasses import dataclass

from turbospark.engine.models import base


@dataclass(slots=True)
class ModelConfig(base.BaseConfig):
    attention_bias: bool = False
    mlp_bias: bool = False


class Attention(base.Attention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias)


class MLP(base.MLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, bias=config.mlp_bias)


class DecoderLayer(base.DecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, Attention(config), MLP(config))


class CausalLM(base.CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions, DecoderLayer)
