"""LlamaForCausalLM over the paged cache vs transformers' own forward, fp32.

Each case writes a tiny random checkpoint with transformers, loads it through
`models.loader`, runs prefill (whole or chunked) and 32 greedy decode steps
through `tests.paged_harness`, and compares every logit row with transformers'
forward over the whole generated sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from models.llama import LlamaForCausalLM
from models.loader import load_model
from tests.paged_harness import assert_matches_reference, run_paged_generation

DECODE_STEPS = 32

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def write_checkpoint(
    path: Path, family: str = "Llama", **overrides: object
) -> transformers.PreTrainedModel:
    """Save a tiny random `<family>ForCausalLM` (Llama, Qwen2, Mistral) and return it."""
    torch.manual_seed(0)
    fields: dict[str, object] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "initializer_range": 0.1,
        "max_position_embeddings": 128,
    }
    fields.update(overrides)
    config = getattr(transformers, f"{family}Config")(**fields)
    reference = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    reference.save_pretrained(path)
    return reference


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def test_single_prompt_prefill_and_decode(tmp_path: Path) -> None:
    reference = write_checkpoint(tmp_path)
    model, config = load_model(tmp_path)
    assert isinstance(model, LlamaForCausalLM)
    prompts = prompts_of([11])
    trace = run_paged_generation(
        model, config.cache_spec(), prompts, chunk_size=64, decode_steps=DECODE_STEPS
    )
    assert trace.num_steps == 1 + DECODE_STEPS  # one whole-prompt prefill step
    assert_matches_reference(reference, prompts, trace, DECODE_STEPS)


def test_batched_prompts_of_different_lengths_llama3_rope(tmp_path: Path) -> None:
    reference = write_checkpoint(tmp_path, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)
    model, config = load_model(tmp_path)
    assert config.rope is not None and config.rope.scaling_type == "llama3"
    prompts = prompts_of([3, 17, 9], seed=2)
    trace = run_paged_generation(
        model, config.cache_spec(), prompts, chunk_size=64, decode_steps=DECODE_STEPS, block_size=8
    )
    assert_matches_reference(reference, prompts, trace, DECODE_STEPS)


@pytest.mark.parametrize("block_major", [False, True], ids=["v1-layout", "v2-layout"])
def test_chunked_prefill_across_block_boundaries(tmp_path: Path, block_major: bool) -> None:
    reference = write_checkpoint(tmp_path, rope_scaling=LLAMA3_ROPE)
    model, config = load_model(tmp_path)
    # Chunks of 5 over blocks of 4: every chunk starts mid-block; the short
    # prompt decodes while the long one is still prefilling (mixed steps).
    prompts = prompts_of([23, 6], seed=3)
    trace = run_paged_generation(
        model,
        config.cache_spec(),
        prompts,
        chunk_size=5,
        decode_steps=DECODE_STEPS,
        block_size=4,
        block_major=block_major,
    )
    assert len(trace.prompt_logits[0]) == 23
    assert_matches_reference(reference, prompts, trace, DECODE_STEPS)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("Qwen2", {}), ("Mistral", {"sliding_window": 6})],
    ids=["qwen2-qkv-bias", "mistral-sliding-window"],
)
def test_other_dense_families(tmp_path: Path, family: str, overrides: dict[str, object]) -> None:
    reference = write_checkpoint(tmp_path, family=family, **overrides)
    model, config = load_model(tmp_path)
    assert config.architecture == f"{family}ForCausalLM"
    if family == "Qwen2":  # random biases, so a dropped bias would show in the logits
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0.0, 0.5)
        reference.save_pretrained(tmp_path)
        model, config = load_model(tmp_path)
    prompts = prompts_of([14, 4], seed=4)
    trace = run_paged_generation(
        model, config.cache_spec(), prompts, chunk_size=5, decode_steps=8, block_size=4
    )
    assert_matches_reference(reference, prompts, trace, 8)
