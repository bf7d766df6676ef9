"""Qwen2.5-VL (model_type "qwen2_5_vl"): Qwen2-VL's design (`qwen2_vl`: the same patches, 2-D
rotary, patch merger, image processor and M-RoPE text model) with another vision tower: RMSNorm
instead of LayerNorm, a gated SiLU MLP, and window attention. Merged patches are regrouped window
by window (windows of `window_size` pixels a side, tokens row-major inside each); blocks listed in
`fullatt_block_indexes` attend over each whole image frame, the others within a window only; the
merger's output goes back to the processor's order, one vector per image token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from turbospark.engine.models import qwen2_vl

VISION_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu")


@dataclass(slots=True)
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280  # the tower's own width (Qwen2-VL calls it embed_dim)
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # pixels a side
    out_hidden_size: int = 3584  # the text model's width
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> VisionConfig:
        known = set(cls.__dataclass_fields__)
        cfg = cls(**{k: v for k, v in config.items() if k in known})
        cfg.fullatt_block_indexes = tuple(int(i) for i in cfg.fullatt_block_indexes)
        rope = config.get("rope_parameters")
        if isinstance(rope, dict):
            cfg.rope_theta = float(rope.get("rope_theta", cfg.rope_theta))
        if cfg.hidden_act not in VISION_ACTS:
            raise ValueError(f"unsupported vision hidden_act {cfg.hidden_act!r}")
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 4:
            raise ValueError("the vision head size must be a multiple of 4 (2-D rotary)")
        if cfg.window_size % (cfg.spatial_merge_size * cfg.patch_size):
            raise ValueError("window_size must be a multiple of spatial_merge_size * patch_size")
        return cfg


@dataclass(slots=True)
class ModelConfig(qwen2_vl.ModelConfig):
    @staticmethod
    def vision_from_dict(config: dict[str, Any]) -> Any:
        return VisionConfig.from_dict(config)


class VisionRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class VisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = qwen2_vl.activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


def vision_block(cfg: VisionConfig) -> qwen2_vl.VisionBlock:
    return qwen2_vl.VisionBlock(
        VisionRMSNorm(cfg.hidden_size),
        VisionRMSNorm(cfg.hidden_size),
        qwen2_vl.VisionAttention(cfg.hidden_size, cfg.num_heads),
        VisionMLP(cfg),
    )


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.width = width
        self.ln_q = VisionRMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # type: ignore[no-any-return]


def windows(grids: Sequence[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """(order, lengths): `order` lists the merged-patch indices (the processor's order, all
    images) window by window (`side` merged patches a side, the edge ones smaller; windows and
    the tokens inside them row-major; frame by frame), `lengths` each window's merged patches."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        hm, wm = h // merge, w // merge
        index = torch.arange(t * hm * wm).view(t, hm, wm) + base
        for frame in range(t):
            for top in range(0, hm, side):
                for left in range(0, wm, side):
                    window = index[frame, top : top + side, left : left + side].flatten()
                    order.append(window)
                    lengths.append(window.numel())
        base += t * hm * wm
    return torch.cat(order), lengths


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.rope_theta = cfg.rope_theta
        self.window_side = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.full_attention = set(cfg.fullatt_block_indexes)
        self.patch_embed = qwen2_vl.PatchEmbed(
            cfg.in_channels, cfg.hidden_size, cfg.temporal_patch_size, cfg.patch_size
        )
        self.blocks = nn.ModuleList([vision_block(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """As Qwen2-VL's tower: patches and their images' patch grids -> one vector of the text
        width per merged patch, in the processor's order."""
        x = self.patch_embed(patches)
        cos, sin = qwen2_vl.vision_rope(grids, self.merge, self.head_dim, self.rope_theta, x.device)
        order, lengths = windows(grids, self.merge, self.window_side)
        order = order.to(x.device)
        unit = self.merge**2  # patches per merged patch, consecutive rows

        def regroup(rows: torch.Tensor) -> torch.Tensor:
            return rows.view(-1, unit, *rows.shape[1:])[order].flatten(0, 1)

        x, rope = regroup(x), (regroup(cos), regroup(sin))
        frames = [h * w for t, h, w in grids for _ in range(t)]  # frames stay contiguous
        in_windows = [n * unit for n in lengths]
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames if i in self.full_attention else in_windows)
        merged = self.merger(x)
        return merged[torch.argsort(order)]  # type: ignore[no-any-return]


class CausalLM(qwen2_vl.CausalLM):
    @staticmethod
    def vision_tower(config: qwen2_vl.ModelConfig) -> nn.Module:
        assert isinstance(config.vision, VisionConfig)
        return VisionTransformer(config.vision)
