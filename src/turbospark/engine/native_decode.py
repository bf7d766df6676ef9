"""A whole decode step of a Llama-style decoder in one native call (`ts_decode_step`).

Each layer of a decode step is ~10 small kernels; run one by one from Python, the glue between
them (ctypes marshalling, output tensors, views, the cache write) cost more than the kernels on
a small model: 7-9 ms of a ~18 ms SmolLM2 token on a 2-core AVX2 EPYC. `NativeDecoder`
describes the model once, as the C structures `ts_layer` / `ts_model` (pointers into the
model's own weight tensors, which stay alive with the model), and a step is then one call over
every layer and the final norm; the lm_head stays a module call.

It runs where every piece fits the kernels: the CPU profile runs the native kernels, every
projection is an int4 (native layout) or int8 linear, the norms are float32, the family's layer
code is the shared one (no q/k norms: Qwen3 keeps the layer-by-layer path), the step is all
decodes (one new token per sequence, at most `native.MAX_ROWS`), and the KV cache is the CPU
backend's layout in float32 or float16. Anything else takes the layer-by-layer path, which
computes the same thing with the same kernels.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from turbospark.engine import native
from turbospark.engine.attention import AttentionMetadata, CpuAttention, decode_slot_ids
from turbospark.engine.cpu_kernels import native_kernels_for
from turbospark.engine.models import base

if TYPE_CHECKING:
    from turbospark.engine.kv_cache import KVCache

_P = ctypes.c_void_p
_I = ctypes.c_int
MAX_HEAD_DIM = 256  # qgemv.c's limits on the attention it computes
MAX_GROUP = 64  # query heads per kv head


class _Linear(ctypes.Structure):
    _fields_ = [
        ("codes", _P),
        ("d16", _P),
        ("m16", _P),
        ("scales", _P),
        ("bias", _P),
        ("bits", _I),
        ("n", _I),
        ("k", _I),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _P),
        ("final_norm", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("num_slots", ctypes.c_int64),
        ("n_layers", _I),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("hd", _I),
        ("inter", _I),
        ("kv_f16", _I),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def _linear(module: nn.Module) -> tuple[_Linear, int] | None:
    """The C description of a quantized linear the native kernels take, with the rows they take."""
    from turbospark.engine.quant import Int4Linear, Int8Linear

    bias = getattr(module, "float_bias", None)
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(module, Int4Linear) and module.q4 is not None and module.native_rows:
        w = module.q4
        desc = _Linear(
            w.codes.data_ptr(),
            w.scales.data_ptr(),
            w.offsets.data_ptr(),
            None,
            bias_ptr,
            4,
            module.out_features,
            module.in_features,
        )
        return desc, module.native_rows
    if isinstance(module, Int8Linear) and module.native_rows and module.q8 is not None:
        desc = _Linear(
            module.q8.codes.data_ptr(),
            None,
            None,
            module.q8.scales.data_ptr(),
            bias_ptr,
            8,
            module.out_features,
            module.in_features,
        )
        return desc, module.native_rows
    return None


def _float32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


class NativeDecoder:
    """The model's layers as `ts_decode_step` reads them; `build` says whether they fit."""

    def __init__(
        self,
        kernels: native.Kernels,
        model: _Model,
        layers: ctypes.Array[_Layer],
        max_rows: int,
        lm: base.CausalLM,
    ) -> None:
        self.lm = lm
        self.kernels = kernels
        self.model = model
        self.layers = layers  # kept: model.layers points into it
        self.max_rows = max_rows
        self.hidden = int(model.hidden)

    @classmethod
    def build(cls, lm: base.CausalLM) -> NativeDecoder | None:
        kernels = native_kernels_for(torch.empty(1, 1))
        if kernels is None or not _float32(lm.model.norm.weight):
            return None
        layers = [layer for layer in lm.model.layers if isinstance(layer, base.DecoderLayer)]
        if len(layers) != len(lm.model.layers) or not layers:
            return None
        config, attn0 = lm.config, layers[0].self_attn
        heads, kv_heads, hd = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        hidden, inter = config.hidden_size, config.intermediate_size
        if hd % 2 or hd > MAX_HEAD_DIM or heads % kv_heads or heads // kv_heads > MAX_GROUP:
            return None
        # (in, out) of q/k/v, o, gate/up, down as the C step computes them
        shapes = [
            (hidden, (heads + 2 * kv_heads) * hd),
            (heads * hd, hidden),
            (hidden, 2 * inter),
            (inter, hidden),
        ]
        descs = (_Layer * len(layers))()
        max_rows = native.MAX_ROWS
        for i, layer in enumerate(layers):
            if not _shared_layer_code(layer):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(_float32(w) for w in norms):
                return None
            parts = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in parts):
                return None
            linears = [p for p in parts if p is not None]
            if [(d.k, d.n) for d, _ in linears] != shapes:
                return None
            max_rows = min([max_rows, *(rows for _, rows in linears)])
            descs[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), *(d for d, _ in linears))
        model = _Model(
            ctypes.cast(descs, _P),
            lm.model.norm.weight.data_ptr(),
            None,
            None,
            0,
            len(layers),
            hidden,
            heads,
            kv_heads,
            hd,
            inter,
            0,
            float(config.rms_norm_eps),
            float(attn0.scale),
        )
        return cls(kernels, model, descs, max_rows, lm)

    def takes(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> bool:
        """Whether this step is one this decoder runs: all decodes, few rows, the CPU backend's
        cache in float32 or float16."""
        rows = input_ids.shape[0]
        k, v = kv_cache.k, kv_cache.v
        return (
            rows <= self.max_rows
            and rows == meta.num_seqs
            and input_ids.is_cpu
            and type(kv_cache.attention) is CpuAttention
            and k.dtype == v.dtype
            and k.dtype in native.KV_DTYPES
            and k.is_cpu
            and k.is_contiguous()
            and v.is_contiguous()
        )

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        on_enter: Callable[[], None],
        *,
        want_ids: bool,
    ) -> tuple[torch.Tensor, list[int] | None]:
        """The model's whole decode step: embeddings, this call, the lm_head. Returns logits
        (rows, vocab) float32 and, with `want_ids` where the lm_head finds them as it writes the
        logits (the native int8 lm_head), each row's argmax; else None."""
        lm = self.lm
        h = self.run(lm.model.embed_tokens(input_ids), lm.rotary(positions), meta, kv_cache, on_enter)
        fused = getattr(lm.lm_head, "forward_argmax", None)
        if want_ids and fused is not None:
            logits, ids = fused(h)
            return logits.float(), None if ids is None else ids.tolist()
        return lm.lm_head(h).float(), None

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: KVCache,
        on_enter: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """x (rows, hidden) float32 token embeddings -> the final norm of the last hidden state;
        the step's keys and values are written to the cache on the way. `on_enter` runs just
        before the C call, which holds no GIL (the runner lets the event loop's wake-ups go
        there: the loop's Python runs while the step computes)."""
        rows = x.shape[0]
        x = x.float().contiguous()
        cos, sin = (t.reshape(rows, -1).float().contiguous() for t in rope)
        slot_ids, offsets = decode_slot_ids(meta)
        model = self.model
        model.k_cache = kv_cache.k.data_ptr()
        model.v_cache = kv_cache.v.data_ptr()
        model.num_slots = kv_cache.k.shape[2]
        model.kv_f16 = int(kv_cache.k.dtype == torch.float16)
        out = torch.empty(rows, self.hidden, dtype=torch.float32)
        on_enter()
        rc = self.kernels.lib.ts_decode_step(
            ctypes.byref(model),
            rows,
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            meta.slot_mapping.data_ptr(),
            slot_ids.data_ptr(),
            offsets.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"native decode step refused {rows} rows (sizes out of range, or no memory)")
        return out


def _shared_layer_code(layer: base.DecoderLayer) -> bool:
    """Whether a layer runs the shared decoder code the C step reproduces (no family override)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        type(layer).forward is base.DecoderLayer.forward
        and type(attn).rotate_qk is base.Attention.rotate_qk
        and type(attn).project is base.Attention.project
        and type(attn).attend is base.Attention.attend
        and type(mlp).gated is base.MLP.gated
        and type(mlp).forward is base.MLP.forward
    )
