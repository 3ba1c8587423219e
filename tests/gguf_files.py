"""Write tiny Llama GGUF files the way llama.cpp's converter does, for tests.

A random transformers `LlamaForCausalLM` is renamed to GGUF tensor names, its
Q/K rows permuted into llama.cpp's RoPE layout, its 2-D weights stored as
`weight_type` (norms stay F32, as llama.cpp keeps them; K-quant weights are
random blocks, see below), and the byte-level
BPE tokenizer of the embedded checkpoints plus a ChatML template written into
the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from models.embedded.tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    SPECIAL_TOKEN_IDS,
    SPECIAL_TOKENS,
    STOP_TOKEN_IDS,
    train_tokenizer,
)

VOCAB_SIZE = 512
LAYERS, HEADS, KV_HEADS = 2, 4, 2
Q = gguf.GGMLQuantizationType
# gguf can dequantize K-quants but not write them: their blocks are random
# bytes with the fp16 scale fields set to `scale`, over rows of 256 values.
K_QUANT_SCALES = {Q.Q4_K: 1e-3, Q.Q5_K: 5e-4, Q.Q6_K: 1e-4}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_tiny_llama_gguf(
    path: Path,
    weight_type: Q,
    architecture: str = "llama",
    tie_word_embeddings: bool = False,
) -> Path:
    """Write the GGUF file `path` and return it."""
    torch.manual_seed(0)
    width = 256 if weight_type in K_QUANT_SCALES else 64  # a multiple of the block size
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=width,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=2 * width,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(path, architecture)
    _write_hyperparameters(writer, config)
    _write_tokenizer(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        _add_tensor(writer, _gguf_name(name), tensor, weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hyperparameters(writer: gguf.GGUFWriter, config: transformers.LlamaConfig) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _write_tokenizer(writer: gguf.GGUFWriter) -> None:
    tokenizer = json.loads(train_tokenizer(VOCAB_SIZE).to_str())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL
            for token in tokens
        ]
    )
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(SPECIAL_TOKEN_IDS[BOS_TOKEN])
    writer.add_eos_token_id(STOP_TOKEN_IDS[0])
    writer.add_chat_template(CHAT_TEMPLATE)


def _gguf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, weight_type: Q) -> None:
    values = tensor.detach().float().numpy()
    if name.endswith("attn_q.weight"):
        values = _permute(values, HEADS)
    elif name.endswith("attn_k.weight"):
        values = _permute(values, KV_HEADS)
    if values.ndim == 1 or weight_type == Q.F32:
        writer.add_tensor(name, values)
    elif weight_type == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
    elif weight_type in K_QUANT_SCALES:
        writer.add_tensor(name, _random_k_blocks(values.shape, weight_type), raw_dtype=weight_type)
    else:
        writer.add_tensor(name, gguf.quantize(values, weight_type), raw_dtype=weight_type)


def _random_k_blocks(shape: tuple[int, ...], weight_type: Q) -> np.ndarray:
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[weight_type]
    rows, blocks_per_row = shape[0], shape[1] // block_values
    blocks = np.random.default_rng(0).integers(
        0, 256, (rows, blocks_per_row, block_bytes), dtype=np.uint8
    )
    scale = np.frombuffer(np.float16(K_QUANT_SCALES[weight_type]).tobytes(), np.uint8)
    if weight_type == Q.Q6_K:  # layout: ql, qh, scales, d
        blocks[..., -2:] = scale
    else:  # layout: d, dmin, scales, ...
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    return blocks.reshape(rows, blocks_per_row * block_bytes)


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave each head's two RoPE halves."""
    rows = weight.shape[0]
    heads = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape)
