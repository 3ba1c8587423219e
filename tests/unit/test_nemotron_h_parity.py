"""NemotronHForCausalLM over the paged cache and Mamba slots vs transformers, fp32.

Each case writes a tiny random Nemotron-H checkpoint with transformers (every
layer kind: pattern "M*-EM*"), loads it through `models.loader`, runs prefill
(whole or in chunks that do not line up with the SSD chunk size) and 32 greedy
decode steps through `tests.paged_harness`, and compares every logit row with
transformers' forward over the whole generated sequence.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from models.errors import CheckpointError
from models.loader import iter_checkpoint_tensors, load_model
from models.nemotron_h import NemotronHForCausalLM
from models.registry import model_preferences
from tests.paged_harness import assert_matches_reference, run_paged_generation

DECODE_STEPS = 32
VOCAB = 128
SSD_CHUNK = 8


def tiny_config(**overrides: object) -> transformers.NemotronHConfig:
    fields: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "hybrid_override_pattern": "M*-EM*",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": SSD_CHUNK,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "initializer_range": 0.1,
        # transformers clamps dt at time_step_min in its multi-token path only;
        # a negligible minimum makes its paths agree with our single rule
        # (clamp to time_step_limit = (0, inf) everywhere).
        "time_step_min": 1e-9,
        # A finite upper limit that never binds: transformers 5 writes an infinite
        # one as {"__float__": "Infinity"}, which models.hf_config does not read yet.
        "time_step_limit": (0.0, 1e6),
        "eos_token_id": 2,
    }
    fields.update(overrides)
    return transformers.NemotronHConfig(**fields)


def randomize_ssm_and_router(model: torch.nn.Module) -> None:
    """Give the parameters transformers initializes to constants random values,
    so the parity check exercises them (dt near its 1e-4 floor would make the
    Mamba layers nearly inert)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mixer.dt_bias", "mixer.D")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif name.endswith("mixer.A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul(3).add(0.2).log())
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)


def write_checkpoint(path: Path, **overrides: object) -> transformers.NemotronHForCausalLM:
    torch.manual_seed(0)
    reference = transformers.NemotronHForCausalLM(tiny_config(**overrides)).eval()
    randomize_ssm_and_router(reference)
    reference.save_pretrained(path)
    return reference


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("nemotron_h")
    return path, write_checkpoint(path)


def test_single_prompt_prefill_and_decode(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, reference = checkpoint
    model, config = load_model(path)
    assert isinstance(model, NemotronHForCausalLM)
    prompts = prompts_of([21])
    trace = run_paged_generation(
        model, config.cache_spec(), prompts, chunk_size=64, decode_steps=DECODE_STEPS
    )
    assert_matches_reference(reference, prompts, trace, DECODE_STEPS)
    # transformers' own cached generation (its one-token Mamba path) agrees too.
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor(prompts),
            max_new_tokens=DECODE_STEPS + 1,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert generated[0, len(prompts[0]) :].tolist() == trace.generated[0]


@pytest.mark.parametrize("block_major", [False, True], ids=["v1-layout", "v2-layout"])
def test_batch_of_prompts_with_chunked_prefill(
    checkpoint: tuple[Path, torch.nn.Module], block_major: bool
) -> None:
    path, reference = checkpoint
    model, config = load_model(path)
    # Prefill chunks of 5 tokens cross the SSD chunk size (8) at varying
    # offsets; the shorter prompts decode while the longer ones still prefill.
    prompts = prompts_of([3, 19, 12], seed=2)
    trace = run_paged_generation(
        model,
        config.cache_spec(),
        prompts,
        chunk_size=5,
        decode_steps=DECODE_STEPS,
        block_major=block_major,
    )
    assert trace.num_steps > DECODE_STEPS + 1  # prefill and decode steps overlapped
    assert_matches_reference(reference, prompts, trace, DECODE_STEPS)


def test_single_group_and_tied_flag_with_saved_head(tmp_path: Path) -> None:
    # transformers' Nemotron-H keeps a separate lm_head under tie_word_embeddings
    # and saves it; the saved head must win over the embedding.
    reference = write_checkpoint(
        tmp_path, tie_word_embeddings=True, n_groups=1, hybrid_override_pattern="ME*M-"
    )
    model, config = load_model(tmp_path)
    assert not torch.equal(model.lm_head.weight, model.backbone.embeddings.weight)
    prompts = prompts_of([10, 17], seed=3)
    trace = run_paged_generation(
        model, config.cache_spec(), prompts, chunk_size=11, decode_steps=DECODE_STEPS
    )
    assert_matches_reference(reference, prompts, trace, DECODE_STEPS)


def test_hybrid_class_prefers_v2_and_python_transceiver() -> None:
    assert model_preferences("NemotronHForCausalLM") == ("v2", "python")


def test_checkpoint_errors_name_the_tensors(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, _ = checkpoint
    model, _ = load_model(path)
    weights = [
        (name, tensor)
        for name, tensor in iter_checkpoint_tensors(path)
        if name != "backbone.layers.0.mixer.A_log"
    ]
    weights.append(("backbone.layers.3.mixer.experts.8.up_proj.weight", torch.zeros(32, 64)))
    weights = [
        (name, torch.zeros(5) if name == "backbone.layers.4.mixer.D" else tensor)
        for name, tensor in weights
    ]
    with pytest.raises(CheckpointError) as err:
        model.load_weights(weights)
    message = str(err.value)
    assert "backbone.layers.0.mixer.A_log" in message
    assert "backbone.layers.3.mixer.experts.8.up_proj.weight" in message
    assert "backbone.layers.4.mixer.D: expected shape (8,), found (5,)" in message


def test_tied_checkpoint_without_head_uses_the_embedding(
    checkpoint: tuple[Path, torch.nn.Module],
) -> None:
    path, _ = checkpoint
    model, config = load_model(path)
    tied = NemotronHForCausalLM(replace(config, tie_word_embeddings=True))
    tied.load_weights(
        (name, tensor) for name, tensor in iter_checkpoint_tensors(path) if name != "lm_head.weight"
    )
    assert torch.equal(tied.lm_head.weight, model.backbone.embeddings.weight)


def test_bfloat16_prompt_logits_track_float32(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, _ = checkpoint
    prompts = prompts_of([9, 20], seed=5)
    traces = []
    for dtype in ("float32", "bfloat16"):
        model, config = load_model(path, dtype=dtype)
        traces.append(
            run_paged_generation(model, config.cache_spec(), prompts, chunk_size=6, decode_steps=4)
        )
    full, half = traces
    # Only prompt rows see identical inputs: bf16 may pick other greedy tokens.
    for i in range(len(prompts)):
        ref, got = full.prompt_logits[i], half.prompt_logits[i]
        assert half.decode_logits[i].shape == full.decode_logits[i].shape
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 5e-2


def test_in_memory_prefix_and_mtp_tensors_load(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, _ = checkpoint
    model, config = load_model(path)
    renamed = [
        (name.replace("backbone.", "model.", 1), tensor)
        for name, tensor in iter_checkpoint_tensors(path)
    ]
    renamed.append(("mtp.layers.0.norm.weight", torch.ones(64)))
    other = NemotronHForCausalLM(config)
    other.load_weights(renamed)
    for (name, ours), (_, theirs) in zip(
        other.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name
