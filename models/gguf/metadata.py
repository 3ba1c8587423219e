"""GGUF metadata -> the body of a Hugging Face `config.json`.

GGUF keys are prefixed by the architecture (`llama.block_count`,
`llama.attention.head_count`, ...). Only Llama-family files are read
(`general.architecture` = `llama`, which llama.cpp also uses for Mistral);
anything else is refused here, before a tensor is touched.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

from models.errors import GGUFError

# GGUF `general.architecture` -> the Hugging Face architecture it is served as.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# Tensor names that mean something this project does not implement.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"


class GGUFMetadata:
    """Typed access to a reader's key-value fields, errors naming the file and key."""

    def __init__(self, reader: GGUFReader, source: str) -> None:
        self.reader = reader
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.source}: metadata key {key!r} is missing")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def tensor_names(self) -> set[str]:
        return {tensor.name for tensor in self.reader.tensors}


def check_architecture(meta: GGUFMetadata) -> str:
    """The GGUF architecture name; `GGUFError` unless this project serves it."""
    arch = meta.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{meta.source}: GGUF architecture {arch!r} is not supported; "
            f"supported GGUF architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if _ROPE_FREQS_TENSOR in meta.tensor_names:
        raise GGUFError(
            f"{meta.source}: tensor {_ROPE_FREQS_TENSOR!r} (Llama 3 RoPE frequency factors) is "
            "not supported from GGUF; serve the Hugging Face checkpoint folder instead"
        )
    return arch


def hf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """The `config.json` body for the model in `meta` (a Llama-family GGUF)."""
    arch = check_architecture(meta)
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": "llama",
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        # llama.cpp writes no output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        **special_token_ids(meta),
    }
    rope_scaling = _rope_scaling(meta, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def vocab_size(meta: GGUFMetadata) -> int:
    arch = meta.architecture
    declared = meta.get(f"{arch}.vocab_size")
    if declared is not None:
        return int(declared)
    field = meta.reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise GGUFError(f"{meta.source}: neither {arch}.vocab_size nor a token list is present")
    return len(field.data)


def special_token_ids(meta: GGUFMetadata) -> dict[str, Any]:
    """`bos_token_id`, `eos_token_id` (a list: eos plus end-of-turn ids) and
    `pad_token_id`, for those the file declares."""
    ids: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        ids["bos_token_id"] = int(bos)
    stops = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(token) for token in stops if token is not None))
    if eos:
        ids["eos_token_id"] = eos
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        ids["pad_token_id"] = int(pad)
    return ids


def _rope_scaling(meta: GGUFMetadata, arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    # Passed on as config.json's rope_scaling; its parser refuses what the
    # model does not implement, with the same message as for a folder.
    scaling: dict[str, Any] = {
        "rope_type": str(kind),
        "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
    }
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
