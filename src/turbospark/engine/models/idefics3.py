"""Idefics3 (model_type "idefics3"): SmolVLM and Idefics3, a SigLIP vision tower, a pixel-shuffle
connector and a Llama text model.

The text model is the shared decoder (`base`, as `llama`) under `model.text_model`; the vision
tower (`model.vision_model`) and the connector (`model.connector`) are plain float torch
modules, never quantized (a few percent of the weights, run once per image). `encode_images`
turns a batch of tiles into one embedding per `<image>` token; the engine injects them at those
tokens' rows (`CausalLM.forward(..., embeds=...)`, see `turbospark.engine.vision`). Weight names
are the checkpoint's (`model.vision_model.encoder.layers.0.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from turbospark.engine.layers import Embedding, RMSNorm
from turbospark.engine.models import base, llama


@dataclass(slots=True)
class VisionConfig:
    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionConfig:
        known = set(cls.__dataclass_fields__)
        cfg = cls(**{k: v for k, v in config.items() if k in known})
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported vision hidden_act {cfg.hidden_act!r}")
        return cfg


@dataclass(slots=True)
class ModelConfig(llama.ModelConfig):
    vision: VisionConfig = field(default_factory=VisionConfig)
    scale_factor: int = 2
    image_token_id: int = 128257

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Self:
        """The text model's settings come from `text_config`; the vision tower's from `vision_config`."""
        text = dict(config.get("text_config") or {})
        text.pop("model_type", None)
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        # (a slots dataclass is a new class: zero-argument super() does not reach it)
        cfg: Self = base.BaseConfig.from_dict.__func__(cls, text)  # type: ignore[attr-defined]
        cfg.vision = VisionConfig.from_dict(dict(config.get("vision_config") or {}))
        cfg.scale_factor = int(config.get("scale_factor", cfg.scale_factor))
        cfg.image_token_id = int(config.get("image_token_id", cfg.image_token_id))
        return cfg

    @property
    def image_seq_len(self) -> int:
        """Embeddings (and `<image>` tokens) per tile."""
        side = self.vision.image_size // self.vision.patch_size
        return side * side // (self.scale_factor**2)


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.num_patches_per_side = cfg.image_size // cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(self.num_patches_per_side**2, cfg.hidden_size)

    def position_ids(self, nb_h: int, nb_w: int, device: torch.device) -> torch.Tensor:
        """transformers' bucketed position ids for an unpadded nb_h x nb_w patch grid (the same
        float ops, so the same buckets)."""
        n = self.num_patches_per_side
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=device)
        h = torch.arange(nb_h, device=device, dtype=torch.float32) * (1.0 / torch.tensor(float(nb_h)))
        w = torch.arange(nb_w, device=device, dtype=torch.float32) * (1.0 / torch.tensor(float(nb_w)))
        bh = torch.bucketize(torch.clamp(h, max=1.0 - 1e-6), boundaries, right=True)
        bw = torch.bucketize(torch.clamp(w, max=1.0 - 1e-6), boundaries, right=True)
        return (bh[:, None] * n + bw[None, :]).reshape(-1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)  # (B, hidden, nb_h, nb_w)
        nb_h, nb_w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(nb_h, nb_w, pixels.device))  # type: ignore[no-any-return]


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = d // self.num_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        shape = (b, s, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional, no padding
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))  # type: ignore[no-any-return]


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))  # type: ignore[no-any-return]


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))  # type: ignore[no-any-return]


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([VisionLayer(cfg) for _ in range(cfg.num_hidden_layers)])


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, patches, hidden)."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)  # type: ignore[no-any-return]


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    """Pixel shuffle (scale_factor**2 patches into one vector), then a linear projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = ModalityProjection(
            config.vision.hidden_size * config.scale_factor**2, config.hidden_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        side = int(seq**0.5)
        f = self.scale_factor
        x = x.view(bsz, side, side // f, dim * f).permute(0, 2, 1, 3)
        x = x.reshape(bsz, side // f, side // f, dim * f * f).permute(0, 2, 1, 3)
        x = x.reshape(bsz, seq // (f * f), dim * f * f)
        return self.modality_projection.proj(x)  # type: ignore[no-any-return]


class Idefics3Model(nn.Module):
    """The checkpoint's `model.` prefix: `text_model` (the shared decoder's embeddings, layers
    and norm, which the base forward reaches as `embed_tokens`, `layers`, `norm`), the vision
    tower and the connector."""

    def __init__(self, config: ModelConfig, text_model: base.Model) -> None:
        super().__init__()
        self.text_model = text_model
        self.vision_model = VisionTransformer(config.vision)
        self.connector = Connector(config)

    @property
    def embed_tokens(self) -> Embedding:
        return self.text_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.text_model.layers

    @property
    def norm(self) -> RMSNorm:
        return self.text_model.norm


class CausalLM(base.CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions, llama.DecoderLayer)
        text_model = self.model
        del self.model
        self.model = Idefics3Model(config, text_model)  # type: ignore[assignment]

    @property
    def image_seq_len(self) -> int:
        return self.config.image_seq_len  # type: ignore[no-any-return]

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grid_thw: torch.Tensor | None = None, /) -> torch.Tensor:
        """Tiles (frames, 3, S, S) -> one text-space embedding per `<image>` token,
        (frames * image_seq_len, hidden), in the tiles' order (`grid_thw`: unused, every tile
        has one shape)."""
        model = self.model
        assert isinstance(model, Idefics3Model)
        vision = model.vision_model
        hidden = vision(pixels.to(vision.post_layernorm.weight.dtype))
        out = model.connector(hidden)
        return out.reshape(-1, out.shape[-1])  # type: ignore[no-any-return]
