"""Qwen2-VL (model_type "qwen2_vl"): a ViT over 14-pixel patches of two frames, 2-D rotary
positions in its attention, full attention within each image, a patch merger (2 x 2 neighbouring
patches into one vector, then an MLP to the text width) and a Qwen2 text model rotated by M-RoPE.

The text model is the shared decoder (`base`, as `qwen2`: biases on q/k/v) under `model.`; the
vision tower (`visual.`) is plain float torch modules, never quantized, run once per image
(`encode_images`). Weight names are the checkpoint's (`visual.blocks.0.attn.qkv.weight`,
`model.layers.0.self_attn.q_proj.weight`, ...).

M-RoPE: each rotary frequency of the text model's heads is driven by one of three positions
(temporal, height, width), the frequencies split in `mrope_section` runs. Where the three are
equal (text, and every token of a prompt without images) that is the ordinary rotary, so the
engine's other paths (the native decode step, CUDA graphs) run such steps unchanged. A step with a
sequence that has images gets its 3-D positions from `turbospark.engine.vision` (`StepEmbeds.mrope`,
which the runner hands to `forward` with the image rows) and runs this forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from turbospark.engine.attention import AttentionMetadata
from turbospark.engine.kv_cache import KVCache
from turbospark.engine.layers import RotaryEmbedding
from turbospark.engine.models import base, qwen2

VISION_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")


@dataclass(slots=True)
class VisionConfig:
    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584  # the text model's width: what the merger projects to
    hidden_act: str = "quick_gelu"
    mlp_ratio: float = 4
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionConfig:
        known = set(cls.__dataclass_fields__)
        cfg = cls(**{k: v for k, v in config.items() if k in known})
        rope = config.get("rope_parameters")
        if isinstance(rope, dict):
            cfg.rope_theta = float(rope.get("rope_theta", cfg.rope_theta))
        if cfg.hidden_act not in VISION_ACTS:
            raise ValueError(f"unsupported vision hidden_act {cfg.hidden_act!r}")
        if cfg.embed_dim % cfg.num_heads or (cfg.embed_dim // cfg.num_heads) % 4:
            raise ValueError("the vision head size must be a multiple of 4 (2-D rotary)")
        return cfg


@dataclass(slots=True)
class ModelConfig(qwen2.ModelConfig):
    vision: VisionConfig = field(default_factory=VisionConfig)
    mrope_section: tuple[int, ...] = (16, 24, 24)
    image_token_id: int = 151655

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Self:
        """The text model's settings from `text_config` (transformers >= 5) or the top level (the
        published checkpoints' flat config.json); the vision tower's from `vision_config`."""
        text = dict(config.get("text_config") or {k: v for k, v in config.items() if k != "vision_config"})
        text.pop("model_type", None)
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        section = None
        for key in ("rope_parameters", "rope_scaling"):  # transformers >= 5, older files
            rope = text.get(key)
            if not isinstance(rope, dict) or "mrope_section" not in rope:
                continue
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in ("default", "mrope"):
                raise ValueError(f"qwen2_vl with rope type {kind!r} is not supported")
            # M-RoPE's frequencies are the plain rotary ones: `mrope_section` only assigns them
            section = rope["mrope_section"]
            if key == "rope_scaling":
                text[key] = None
            else:
                text[key] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
        # (a slots dataclass is a new class: zero-argument super() does not reach it)
        cfg: Self = base.BaseConfig.from_dict.__func__(cls, text)  # type: ignore[attr-defined]
        cfg.vision = cls.vision_from_dict(dict(config.get("vision_config") or {}))
        if section is not None:
            cfg.mrope_section = tuple(int(s) for s in section)
        if sum(cfg.mrope_section) != cfg.head_dim // 2:
            raise ValueError(f"mrope_section {list(cfg.mrope_section)} does not add up to head_dim / 2")
        cfg.image_token_id = int(config.get("image_token_id", cfg.image_token_id))
        return cfg

    @staticmethod
    def vision_from_dict(config: dict[str, Any]) -> Any:
        """The family's vision tower settings."""
        return VisionConfig.from_dict(config)


class MRopeRotary(RotaryEmbedding):
    """The ordinary rotary tables, plus the lookup by 3-D positions (`mrope`)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        half = torch.tensor([i for i, n in enumerate(config.mrope_section) for _ in range(n)])
        self.section: torch.Tensor
        self.register_buffer("section", torch.cat([half, half]), persistent=False)

    def mrope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (3, num_tokens) -> cos, sin (num_tokens, 1, head_dim): each column read
        from the table row of the position its section names."""
        index = self.section.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0]  # (3, n, d) -> (n, d)
        sin = self.sin[positions].gather(0, index)[0]
        return cos.unsqueeze(1), sin.unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel is its stride: one linear map of each flattened patch."""

    def __init__(self, in_channels: int, width: int, temporal_patch_size: int, patch_size: int) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, width, kernel, kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: Sequence[int]
    ) -> torch.Tensor:
        """x (patches, embed_dim); attention is full within each span of `spans` (lengths, in
        order: one per image frame) and never across."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # (n, heads, head_dim)
        cos, sin = rope  # (n, 1, head_dim) float32
        dtype = q.dtype
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(dtype)
        outs = [
            F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            for qs, ks, vs in zip(q.split(spans), k.split(spans), v.split(spans), strict=True)
        ]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))  # type: ignore[no-any-return]


def activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return QuickGELU()
    if name == "silu":
        return nn.SiLU()
    return nn.GELU(approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, hidden)
        self.act = activation(cfg.hidden_act)
        self.fc2 = nn.Linear(hidden, cfg.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # type: ignore[no-any-return]


class VisionBlock(nn.Module):
    """A pre-norm residual block of the vision tower: its parts given (the two Qwen VL towers
    differ in the norm and the MLP, not in how a block runs them)."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    @classmethod
    def of(cls, cfg: VisionConfig) -> VisionBlock:
        return cls(
            nn.LayerNorm(cfg.embed_dim, eps=1e-6),
            nn.LayerNorm(cfg.embed_dim, eps=1e-6),
            VisionAttention(cfg.embed_dim, cfg.num_heads),
            VisionMLP(cfg),
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: Sequence[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, spans)
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class PatchMerger(nn.Module):
    """merge**2 neighbouring patches (consecutive rows: the processor lays patches out merge
    block by merge block) normed, concatenated and projected to the text width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.width = width
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # type: ignore[no-any-return]


def vision_rope(
    grids: Sequence[tuple[int, int, int]], merge: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (patches, 1, head_dim) of the 2-D rotary, patches in the processor's order (merge
    blocks row-major, then the patches inside a block; every frame alike): the first half of
    each half of the head rotates by the patch's row, the second by its column, one frequency set
    for both."""
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    for t, h, w in grids:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        hh = hh.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()
        ww = ww.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()
        rows.append(hh.repeat(t))
        cols.append(ww.repeat(t))
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
    fh = torch.cat(rows)[:, None].float() * inv_freq
    fw = torch.cat(cols)[:, None].float() * inv_freq
    half = torch.cat([fh, fw], dim=-1)
    angles = torch.cat([half, half], dim=-1).to(device)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.head_dim = cfg.embed_dim // cfg.num_heads
        self.rope_theta = cfg.rope_theta
        self.patch_embed = PatchEmbed(cfg.in_channels, cfg.embed_dim, cfg.temporal_patch_size, cfg.patch_size)
        self.blocks = nn.ModuleList([VisionBlock.of(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """patches (sum of t*h*w, 3 * t_patch * p * p), their images' patch grids -> one vector
        of the text width per merged patch (sum of t*h*w / merge**2, hidden)."""
        x = self.patch_embed(patches)
        rope = vision_rope(grids, self.merge, self.head_dim, self.rope_theta, x.device)
        spans = [h * w for t, h, w in grids for _ in range(t)]  # each frame attends to itself
        for block in self.blocks:
            x = block(x, rope, spans)
        return self.merger(x)  # type: ignore[no-any-return]


class CausalLM(base.CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions, qwen2.DecoderLayer)
        self.rotary = MRopeRotary(config, max_positions)
        self.visual: nn.Module = self.vision_tower(config)

    @staticmethod
    def vision_tower(config: ModelConfig) -> nn.Module:
        """The family's vision tower (`visual.` in the checkpoint)."""
        return VisionTransformer(config.vision)

    @property
    def spatial_merge_size(self) -> int:
        return self.config.vision.spatial_merge_size  # type: ignore[no-any-return]

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id  # type: ignore[no-any-return]

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grid_thw: torch.Tensor | None = None, /) -> torch.Tensor:
        """The patches of one or more images (their `pixel_values` concatenated) and their patch
        grids (images, 3) -> one text-space embedding per image token, in order."""
        assert grid_thw is not None, "qwen2_vl needs each image's patch grid"
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        dtype = next(self.visual.parameters()).dtype
        return self.visual(pixels.to(dtype), grids)  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As the shared decoder's, rotated by the step's 3-D positions where `embeds` carries
        them (`turbospark.engine.vision.StepEmbeds.mrope`), else by `positions` (text only)."""
        x = self.model.embed_tokens(input_ids)
        mrope = getattr(embeds, "mrope", None)
        if embeds is not None and embeds[0].numel():
            x.index_copy_(0, embeds[0], embeds[1].to(x.dtype))
        rotary = self.rotary
        assert isinstance(rotary, MRopeRotary)
        rope = rotary.mrope(mrope) if mrope is not None else rotary(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, kv_cache.layer(i), meta)
        assert residual is not None
        return self.logits(x, residual, meta.last_token_indices)
