"""GGUF tensors -> Hugging Face named torch tensors.

GGUF stores shapes innermost-first (`[in_features, out_features]` for a
linear weight); the reader's numpy view is already row-major
(`[out_features, in_features]`), the layout torch and safetensors use.

llama.cpp permutes the rows of Q and K when it converts a Hugging Face Llama,
so that its RoPE can rotate adjacent pairs (x0, x1), (x2, x3), ... instead of
Hugging Face's halves (x0, x_{d/2}), ... Per head of `d` rows:

    Hugging Face rows   0 1 2 ... d/2-1 | d/2 ... d-1
    GGUF rows           0 d/2 1 d/2+1 2 ...            (halves interleaved)

`unpermute_rows` undoes it, so the weights fit our (Hugging Face style) RoPE.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor, dequantize

from models.errors import GGUFError

Q = GGMLQuantizationType
# What dequantizes, and to which dtype it is kept. Quantized blocks become
# fp32, which holds their values exactly; the loader casts to the serving dtype.
SUPPORTED_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
    Q.Q8_0: torch.float32,
    Q.Q4_0: torch.float32,
    Q.Q4_1: torch.float32,
    Q.Q4_K: torch.float32,
    Q.Q5_K: torch.float32,
    Q.Q6_K: torch.float32,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def check_tensor_types(tensors: list[ReaderTensor], source: str) -> None:
    """`GGUFError` naming the first tensor whose type cannot be dequantized."""
    for tensor in tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise GGUFError(
                f"{source}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is "
                f"not supported; supported types: {supported}"
            )


def hf_name(gguf_name: str, source: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor; `GGUFError` for an unknown one."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is not None and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise GGUFError(f"{source}: tensor {gguf_name!r} has no counterpart in a Llama model")


def output_dtype(tensor: ReaderTensor) -> torch.dtype:
    return SUPPORTED_TYPES[tensor.tensor_type]


def to_torch(tensor: ReaderTensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The tensor dequantized, in Hugging Face row order (Q/K unpermuted)."""
    values = _dequantized(tensor)
    if tensor.name.endswith(".attn_q.weight"):
        values = unpermute_rows(values, num_heads)
    elif tensor.name.endswith(".attn_k.weight"):
        values = unpermute_rows(values, num_kv_heads)
    return values


def _dequantized(tensor: ReaderTensor) -> torch.Tensor:
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type == Q.F16:  # kept as is: no widening to fp32
        return torch.from_numpy(np.array(tensor.data.view(np.float16))).reshape(shape)
    values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
    return values.reshape(shape).to(output_dtype(tensor))


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the two RoPE halves (see above)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    heads = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return heads.transpose(1, 2).reshape(weight.shape).contiguous()
