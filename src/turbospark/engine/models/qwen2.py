"""Qwen2 (model_type "qwen2"): Qwen2 and Qwen2.5. Llama's shape with biases on q/k/v (not o)."""

from __future__ import annotations

from dataclasses import dataclass

from turbospark.engine.models import base


@dataclass(slots=True)
class ModelConfig(base.BaseConfig):
    use_sliding_window: bool = False

    def validate(self) -> None:
        if self.use_sliding_window:
            raise ValueError("qwen2 with use_sliding_window is not supported")
        base.BaseConfig.validate(self)


class Attention(base.Attention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, qkv_bias=True, o_bias=False)


MLP = base.MLP


class DecoderLayer(base.DecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, Attention(config), MLP(config))


class CausalLM(base.CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions, DecoderLayer)
