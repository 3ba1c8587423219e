"""TensorRT-LLM disagg YAML read as ours, and `disagg config check` / `convert`.

The files under tests/configs/trtllm/ are in TensorRT-LLM's shape; each is
checked with a local tiny checkpoint passed as --model, and must print the
plan written here. Two of them are also served end to end with greedy parity
(tests/integration/test_serve_openai.py, test_edge_errors.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.cli import main
from cluster.config.plan import resolve_plan
from cluster.config.reader import LoadedConfig, load_config, read_config
from cluster.config.schema import ConfigError, SnapshotsConfig, config_from_dict
from cluster.config.trtllm import is_trtllm, translate
from engine.speculation.config import SpeculativeConfig
from transfer.nixl.agent import nixl_available

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "configs" / "trtllm"
NIXL = nixl_available()
AUTO = "nixl" if NIXL else "python"  # what backend DEFAULT resolves to on a dense model

# file -> expected plan rows: (instance, manager, transceiver, block, blocks, slots, device)
PLANS: dict[str, list[tuple[str, ...]]] = {
    # Each section's kv_cache_config fraction, 0.3 of its rank's half of
    # HOST_BYTES: 0.3 x 512 MiB in blocks of 8 KiB.
    "1p1d-default.yaml": [
        ("context-0", "v2", AUTO, "16", "19660", "0", "cpu", "1"),
        # NIXL needs one layout: the generation side follows the context's V2.
        ("generation-0", "v2" if NIXL else "v1", AUTO, "16", "19660", "0", "cpu", "1"),
    ],
    "2p2d-python-reuse.yaml": [
        (f"{role}-{i}", "v2", "python", "16", "513", "0", "cpu", "1")
        for role in ("context", "generation")
        for i in range(2)
    ],
    "nixl-load-balancing.yaml": [
        ("context-0", "v1", "nixl", "32", "129", "0", "cpu", "1"),
        ("context-1", "v1", "nixl", "32", "129", "0", "cpu", "1"),
        ("generation-0", "v1", "nixl", "32", "257", "0", "cpu", "1"),
    ],
    "ucx-round-robin.yaml": [
        ("context-0", "v1", "python", "16", "129", "0", "cpu", "1"),
        ("generation-0", "v1", "python", "16", "129", "0", "cpu", "1"),
        ("generation-1", "v1", "python", "16", "129", "0", "cpu", "1"),
    ],
    "mpi-conditional.yaml": [
        ("context-0", "v1", "python", "8", "129", "0", "cpu", "1"),
        ("generation-0", "v1", "python", "8", "129", "0", "cpu", "1"),
    ],
    "gpu-fraction.yaml": [
        ("context-0", "v1", "python", "16", "by memory", "0", "cuda", "1"),
        ("generation-0", "v1", "python", "16", "1025", "0", "cuda", "1"),
    ],
    "1p1d-python-small-cache.yaml": [
        ("context-0", "v1", "python", "16", "17", "0", "cpu", "1"),
        ("generation-0", "v1", "python", "16", "17", "0", "cpu", "1"),
    ],
    # 0.02 and 0.01 of a rank's 512 MiB share of HOST_BYTES, in blocks of 8 KiB.
    "cache-reuse-fractions.yaml": [
        ("context-0", "v2", "python", "16", "1310", "0", "cpu", "1"),
        ("generation-0", "v2", "python", "16", "655", "0", "cpu", "1"),
    ],
    # Reuse on a hybrid keeps max_batch_size (32) Mamba state snapshots.
    "nemotron-h-default.yaml": [
        ("context-0", "v2", "python", "16", "129", "64 + 32 snapshots, 0.3 MiB", "cpu", "1"),
        ("generation-0", "v2", "python", "16", "129", "64 + 32 snapshots, 0.3 MiB", "cpu", "1"),
    ],
    "ngram-speculative.yaml": [
        ("context-0", "v1", "python", "16", "129", "0", "cpu", "1"),
        ("generation-0", "v1", "python", "16", "129", "0", "cpu", "1"),
    ],
    # 0.1 of a rank's 512 MiB share of HOST_BYTES, in blocks that hold the MTP
    # attention layer's KV beside the backbone's two (6421 blocks without it);
    # one draft a step on both roles.
    "nemotron-h-one-mtp.yaml": [
        ("context-0", "v2", "python", "16", "4281", "64 + 32 verify", "cpu", "1"),
        ("generation-0", "v2", "python", "16", "4281", "64 + 32 verify", "cpu", "1"),
    ],
}

# file -> (our keys the translation must set, file keys it must list as ignored)
TRANSLATIONS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "1p1d-default.yaml": (
        {
            "router.type": "prefix_aware",
            "conditional_disagg.max_local_prefill_length": 256,
            "context_servers.kv_cache.enable_block_reuse": True,
            "context_servers.cache_transceiver.backend": "auto",
            "context_servers.cache_transceiver.timeout_s": 30.0,
            "context_servers.kv_cache.memory_fraction": 0.3,
            "generation_servers.kv_cache.memory_fraction": 0.3,
        },
        {
            "backend",
            "disable_overlap_scheduler",
            # Both sections' kv_cache_config fractions win over it.
            "free_gpu_memory_fraction",
            "context_servers.kv_cache_config.enable_partial_reuse",
            "context_servers.kv_cache_config.event_buffer_max_size",
            "context_servers.cache_transceiver_config.max_tokens_in_buffer",
            "context_servers.urls",
            "generation_servers.urls",
        },
    ),
    "2p2d-python-reuse.yaml": (
        {"router.type": "prefix_aware", "kv_cache.manager": "v2"},
        {"backend", "context_servers.urls", "generation_servers.urls"},
    ),
    "nixl-load-balancing.yaml": (
        {
            "router.type": "least_loaded",
            "context_servers.cache_transceiver.timeout_s": 5.0,
            "generation_servers.kv_cache.max_tokens": 8192,
            "context_servers.max_num_tokens": 256,
        },
        {
            "context_servers.router.use_tokens",
            "context_servers.cuda_graph_config",
            "generation_servers.print_iter_log",
        },
    ),
    "ucx-round-robin.yaml": (
        {
            "router.type": "round_robin",
            "cache_transceiver.backend": "python",
            "cache_transceiver.wire": "ucx",
            "max_batch_size": 16,
        },
        {"enable_autotuner", "cache_transceiver_config.transceiver_runtime"},
    ),
    "mpi-conditional.yaml": (
        {
            "conditional_disagg.max_local_prefill_length": 64,
            "cache_transceiver.backend": "python",
            "kv_cache.enable_block_reuse": False,
        },
        {
            "max_retries",
            "cache_transceiver_config.backend",
            "cache_transceiver_config.max_tokens_in_buffer",
        },
    ),
    "gpu-fraction.yaml": (
        {"kv_cache.memory_fraction": 0.85, "generation_servers.kv_cache.max_tokens": 16384},
        set(),
    ),
    "1p1d-python-small-cache.yaml": (
        {"kv_cache.max_tokens": 256, "max_num_tokens": 256},
        {
            "backend",
            "disable_overlap_scheduler",
            "enable_autotuner",
            "print_iter_log",
            "cuda_graph_config",
            "kv_cache_config.free_gpu_memory_fraction",
            "cache_transceiver_config.max_tokens_in_buffer",
            "context_servers.urls",
            "generation_servers.urls",
        },
    ),
    "cache-reuse-fractions.yaml": (
        {
            "context_servers.kv_cache.memory_fraction": 0.02,
            "generation_servers.kv_cache.memory_fraction": 0.01,
            "context_servers.kv_cache.manager": "v2",
            "generation_servers.kv_cache.enable_block_reuse": True,
            "context_servers.max_num_tokens": 3000,
        },
        {
            "backend",
            # Overridden on the generation side only; it sizes the context side.
            "free_gpu_memory_fraction",
            "context_servers.kv_cache_config.enable_partial_reuse",
            "generation_servers.kv_cache_config.enable_partial_reuse",
            "context_servers.urls",
            "generation_servers.urls",
        },
    ),
    "nemotron-h-default.yaml": (
        {"kv_cache.enable_block_reuse": True, "cache_transceiver.backend": "auto"},
        {"backend", "kv_cache_config.mamba_ssm_cache_dtype"},
    ),
    "ngram-speculative.yaml": (
        {
            "generation_servers.speculative_config.method": "ngram",
            "generation_servers.speculative_config.num_speculative_tokens": 4,
            "generation_servers.speculative_config.prompt_lookup_min": 1,
            "generation_servers.speculative_config.prompt_lookup_max": 3,
        },
        {
            "backend",
            "disable_overlap_scheduler",
            # A context worker samples only the first token: it never drafts.
            "context_servers.speculative_config",
            "generation_servers.speculative_config.is_keep_all",
            "generation_servers.speculative_config.is_use_oldest",
            "generation_servers.speculative_config.is_public_pool",
            "context_servers.urls",
            "generation_servers.urls",
        },
    ),
    "nemotron-h-one-mtp.yaml": (
        {
            "speculative_config.method": "mtp",
            "speculative_config.num_speculative_tokens": 1,
            "kv_cache.memory_fraction": 0.1,
            "context_servers.tensor_parallel_size": 1,
        },
        {
            "backend",
            "cuda_graph_config",
            "disable_overlap_scheduler",
            "context_servers.enable_attention_dp",
            "generation_servers.enable_attention_dp",
        },
    ),
}


# What the host gives new allocations, as the plan reads it: fixed here, so a
# memory fraction on CPU instances sizes the same cache on any machine.
HOST_BYTES = 1 << 30


@pytest.fixture(autouse=True)
def fixed_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cluster.config.plan.host_available_bytes", lambda: HOST_BYTES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from models.embedded.writer import ensure_checkpoint

    root = tmp_path_factory.mktemp("trtllm")
    held = {arch: ensure_checkpoint(root / arch, arch, "tiny") for arch in ("llama", "nemotron_h")}
    # With one MTP step (attention + MoE, as released) and its mtp.* tensors.
    mtp = ensure_checkpoint(root / "nemotron_h_mtp", "nemotron_h", "tiny", mtp=True)
    return held | {"nemotron_h_mtp": mtp}


def _model_for(name: str, checkpoints: dict[str, Path]) -> Path:
    if "mtp" in name:
        return checkpoints["nemotron_h_mtp"]
    return checkpoints["nemotron_h" if name.startswith("nemotron") else "llama"]


def _check(path: Path, model: Path | None, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    argv = ["config", "check", "-c", str(path)] + ([] if model is None else ["--model", str(model)])
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _plan_rows(out: str) -> list[tuple[str, ...]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("instance "))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        name, _role, *rest = re.split(r"\s{2,}", line.strip())
        rows.append((name, *rest))
    return rows


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _dotted(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_at_least_six_trtllm_configs_are_held_and_all_are_recognized() -> None:
    files = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert len(files) >= 6 and set(files) == set(PLANS)
    for name in files:
        assert is_trtllm(yaml.safe_load((CONFIGS / name).read_text())), name
    for native in (ROOT / "deploy" / "configs").glob("*.yaml"):
        assert not is_trtllm(yaml.safe_load(native.read_text())), native.name


@pytest.mark.parametrize("name", sorted(PLANS))
def test_config_check_prints_the_expected_plan_translation_and_ignored_keys(
    name: str, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model_for(name, checkpoints)
    code, out = _check(CONFIGS / name, model, capsys)
    assert code == 0, out
    assert _plan_rows(out) == PLANS[name]
    printed = out.split("config in disagg keys:\n", 1)[1].split("\ntensorrt-llm config:", 1)[0]
    # The printed YAML is the config serve runs: it validates and resolves to the same plan.
    printed_config = config_from_dict(yaml.safe_load(printed))
    assert printed_config.model == str(model)
    loaded = read_config(CONFIGS / name)
    assert loaded.dialect == "tensorrt-llm"
    assert resolve_plan(printed_config) == resolve_plan(
        loaded.config.model_copy(update={"model": str(model)})
    )
    expected_keys, expected_ignored = TRANSLATIONS[name]
    flat = _dotted(loaded.config.model_dump(exclude_unset=True))
    for key, value in expected_keys.items():
        assert flat[key] == value, key
    assert {item.split(": ", 1)[0] for item in loaded.ignored} == expected_ignored
    for item in expected_ignored:
        assert f"  {item}: " in out


def test_config_check_reads_our_own_dialect_too(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = ROOT / "deploy" / "configs" / "nixl.yaml"
    code, out = _check(path, checkpoints["llama"], capsys)
    assert code == 0, out
    assert [row[1:3] for row in _plan_rows(out)] == [("v1", "nixl"), ("v1", "nixl")]
    printed = out.split("config in disagg keys:\n", 1)[1].split("\ndisagg config:", 1)[0]
    expected = load_config(path).model_copy(update={"model": str(checkpoints["llama"])})
    assert config_from_dict(yaml.safe_load(printed)) == expected
    assert out.rstrip().endswith("disagg config: no key ignored")


def test_the_2p2d_translation_is_exactly_the_native_2p2d_config() -> None:
    native = load_config(ROOT / "deploy" / "configs" / "2p2d.yaml")
    assert load_config(CONFIGS / "2p2d-python-reuse.yaml") == native


def test_reuse_on_a_hybrid_model_keeps_snapshots_and_none_without_slots(
    checkpoints: dict[str, Path],
) -> None:
    loaded = read_config(CONFIGS / "nemotron-h-default.yaml")
    config = loaded.config.model_copy(update={"model": str(checkpoints["nemotron_h"])})
    instances = resolve_plan(config).instances
    assert all(i.enable_block_reuse for i in instances)
    assert all(i.snapshots is not None and i.snapshots.num_slots == 32 for i in instances)
    assert all(i.snapshots is not None and i.snapshots.at_end for i in instances)
    no_slots = config.model_copy(
        update={
            "kv_cache": config.kv_cache.model_copy(
                update={"snapshots": SnapshotsConfig(num_slots=0)}
            )
        }
    )
    instances = resolve_plan(no_slots).instances
    assert not any(i.enable_block_reuse or i.snapshots for i in instances)
    reuse = read_config(CONFIGS / "2p2d-python-reuse.yaml").config
    config = reuse.model_copy(update={"model": str(checkpoints["llama"])})
    assert all(i.enable_block_reuse for i in resolve_plan(config).instances)


def test_a_hub_id_model_says_to_download_it_in_check_and_in_serve(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = CONFIGS / "1p1d-default.yaml"
    code, out = _check(path, None, capsys)
    assert code == 1
    assert f"error: {path}:model: 'meta-llama/Llama-3.1-8B-Instruct' is not a local folder" in out
    assert "download it first" in out and "--model" in out
    assert main(["serve", "-c", str(path)]) == 2
    assert capsys.readouterr().err.strip() == out.strip()


def test_convert_writes_our_yaml_that_loads_to_the_same_config(tmp_path: Path) -> None:
    source = CONFIGS / "1p1d-python-small-cache.yaml"
    out = tmp_path / "native.yaml"
    assert main(["config", "convert", "-c", str(source), "-o", str(out)]) == 0
    text = out.read_text()
    assert "#   context_servers.urls: this launcher starts its own workers" in text
    converted = read_config(out)
    assert converted == LoadedConfig(read_config(source).config, "disagg")


# -- refusals: each names the keys as the file wrote them ------------------


def _translate(raw: dict[str, Any]) -> Any:
    return config_from_dict(*_native(raw))


def _native(raw: dict[str, Any]) -> tuple[dict[str, Any], str, dict[str, str]]:
    translation = translate({"model": "m", **raw}, "t.yaml")
    return translation.native, "t.yaml", translation.key_names


def test_one_setting_in_both_dialects_is_refused_naming_both_keys() -> None:
    raw: dict[str, Any] = {
        "kv_cache": {"max_tokens": 4096},
        "kv_cache_config": {"max_tokens": 4096},
    }
    with pytest.raises(ConfigError) as info:
        _translate(raw)
    message = str(info.value)
    assert "kv_cache.max_tokens and kv_cache_config.max_tokens" in message
    assert "one in TensorRT-LLM's keys and one in ours" in message
    # Refused even where the TensorRT-LLM key would be ignored (a fraction on CPU).
    raw = {"kv_cache": {"memory_fraction": 0.5}, "free_gpu_memory_fraction": 0.5}
    with pytest.raises(ConfigError, match="kv_cache.memory_fraction and free_gpu_memory_fraction"):
        _translate(raw)


def test_a_section_inherits_top_level_keys_and_its_kv_cache_config_fraction_wins() -> None:
    # TensorRT-LLM's own disagg_config_cache_reuse.yaml has this shape.
    raw = {
        "free_gpu_memory_fraction": 0.15,
        "context_servers": {"kv_cache_config": {"enable_block_reuse": True}},
        "generation_servers": {"kv_cache_config": {"free_gpu_memory_fraction": 0.05}},
    }
    translation = translate({"model": "m", **raw}, "t.yaml")
    config = config_from_dict(translation.native, "t.yaml", translation.key_names)
    assert config.role_settings("context_servers").kv_cache.memory_fraction == 0.15
    assert config.role_settings("generation_servers").kv_cache.memory_fraction == 0.05
    assert translation.key_names["generation_servers.kv_cache.memory_fraction"] == (
        "generation_servers.kv_cache_config.free_gpu_memory_fraction"
    )
    assert translation.key_names["context_servers.kv_cache.memory_fraction"] == (
        "free_gpu_memory_fraction"
    )
    # The same holds when the nested fraction is the inherited one.
    raw = {
        "kv_cache_config": {"free_gpu_memory_fraction": 0.3},
        "generation_servers": {"free_gpu_memory_fraction": 0.6},
    }
    config = _translate(raw)
    assert config.kv_cache.memory_fraction == 0.3
    assert config.role_settings("generation_servers").kv_cache.memory_fraction == 0.3


def test_a_section_that_sets_a_top_level_key_to_another_value_is_refused_naming_both() -> None:
    raw = {
        "free_gpu_memory_fraction": 0.2,
        "context_servers": {"free_gpu_memory_fraction": 0.3},
    }
    with pytest.raises(
        ConfigError, match=r"free_gpu_memory_fraction is 0\.2 at the top level but context_servers"
    ):
        _translate(raw)
    # The key is compared whole, as TensorRT-LLM does: a section's kv_cache_config
    # that differs from the top-level one in any field is refused.
    raw = {
        "kv_cache_config": {"tokens_per_block": 16},
        "generation_servers": {"kv_cache_config": {"tokens_per_block": 16, "max_tokens": 64}},
    }
    with pytest.raises(ConfigError) as info:
        _translate(raw)
    message = str(info.value)
    assert "kv_cache_config is {'tokens_per_block': 16} at the top level but" in message
    assert "generation_servers.kv_cache_config is {'tokens_per_block': 16, 'max_tokens': 64}" in (
        message
    )
    assert "TensorRT-LLM refuses this file too" in message
    same = {
        "kv_cache_config": {"tokens_per_block": 32},
        "context_servers": {"kv_cache_config": {"tokens_per_block": 32}},
    }
    assert _translate(same).role_settings("context_servers").kv_cache.block_size == 32


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"max_batch_size": "eight", "context_servers": {"max_batch_size": 8}},
            "t.yaml:max_batch_size: Input should be a valid integer",
        ),
        (
            {"tensor_parallel_size": "one", "context_servers": {"tensor_parallel_size": 1}},
            "t.yaml:tensor_parallel_size: Input should be a valid integer",
        ),
        (
            {
                "kv_cache_config": {"tokens_per_block": "sixteen"},
                "context_servers": {"kv_cache_config": {"tokens_per_block": 16}},
            },
            "t.yaml:kv_cache_config.tokens_per_block (our kv_cache.block_size): Input should "
            "be a valid integer",
        ),
        (
            # Ignored beside the section's kv_cache_config fraction, but still no number.
            {
                "free_gpu_memory_fraction": "lots",
                "context_servers": {"kv_cache_config": {"free_gpu_memory_fraction": 0.3}},
            },
            "t.yaml:free_gpu_memory_fraction (our kv_cache.memory_fraction): Input should be "
            "a valid number",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_reported_as_that_not_as_a_conflict(
    raw: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _translate(raw)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "set it in one place" not in message and message.count("\n") == 0, message


def test_two_different_section_routers_are_refused() -> None:
    raw = {
        "context_servers": {"router": {"type": "kv_cache_aware"}},
        "generation_servers": {"router": {"type": "round_robin"}},
    }
    with pytest.raises(ConfigError) as info:
        _translate(raw)
    message = str(info.value)
    assert "context_servers.router.type is 'kv_cache_aware'" in message
    assert "generation_servers.router.type is 'round_robin'" in message
    assert "one router policy serves both pools" in message


@pytest.mark.parametrize(
    ("raw", "where", "hint"),
    [
        ({"kv_cache_confg": {}, "backend": "pytorch"}, "kv_cache_confg", "'kv_cache_config'"),
        ({"context_servers": {"url": []}}, "context_servers.url", "'urls'"),
        (
            {"kv_cache_config": {"tokens_per_blok": 8}},
            "kv_cache_config.tokens_per_blok",
            "'tokens_per_block'",
        ),
        ({"backend": "pytorch", "kv_cach": {}}, "kv_cach", "'kv_cache'"),
    ],
)
def test_unknown_keys_suggest_the_closest_name_in_either_dialect(
    raw: dict[str, Any], where: str, hint: str
) -> None:
    with pytest.raises(ConfigError, match=f"t.yaml:{where}: unknown key; did you mean {hint}"):
        _translate(raw)


def test_refused_values_and_keys_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="pipeline_parallel_size: is 2, but pipeline parallelism"):
        _translate({"context_servers": {"pipeline_parallel_size": 2}})
    with pytest.raises(ConfigError, match="'GLOO' is not a backend; use one of DEFAULT, NIXL"):
        _translate({"cache_transceiver_config": {"backend": "GLOO"}})
    with pytest.raises(ConfigError, match="max_attention_window: a sliding attention window"):
        _translate({"kv_cache_config": {"max_attention_window": [512]}})
    bad = {"kv_cache_config": {"tokens_per_block": 0}}
    with pytest.raises(
        ConfigError, match=r"kv_cache_config.tokens_per_block \(our kv_cache.block_size\)"
    ):
        _translate(bad)
    with pytest.raises(
        ConfigError,
        match="guided_decoding_backend: is 'llguidance', but structured output here runs on "
        "xgrammar; set it to xgrammar or leave it out",
    ):
        _translate({"context_servers": {"guided_decoding_backend": "llguidance"}})


def test_a_fraction_sizes_gpu_and_cpu_instances_and_max_tokens_wins(tmp_path: Path) -> None:
    gpu = {"context_servers": {"num_gpus": 1}, "generation_servers": {"num_gpus": 1}}
    config = _translate({"free_gpu_memory_fraction": 0.5, **gpu})
    assert config.kv_cache.memory_fraction == 0.5
    mixed = _translate({"free_gpu_memory_fraction": 0.5, "context_servers": {"num_gpus": 1}})
    assert mixed.kv_cache.memory_fraction == 0.5
    assert mixed.role_settings("generation_servers").kv_cache.memory_fraction == 0.5
    both = translate(
        {
            "model": "m",
            "kv_cache_config": {"free_gpu_memory_fraction": 0.5, "max_tokens": 64},
            **gpu,
        }
    )
    assert both.native["kv_cache"] == {"max_tokens": 64}
    assert [str(i).split(":")[0] for i in both.ignored] == [
        "kv_cache_config.free_gpu_memory_fraction"
    ]


def test_config_check_says_where_each_effective_value_came_from(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _check(CONFIGS / "cache-reuse-fractions.yaml", checkpoints["llama"], capsys)
    assert code == 0, out
    lines = out.splitlines()
    gen = "  generation_servers.kv_cache.memory_fraction = 0.01  <- "
    assert f"{gen}generation_servers.kv_cache_config.free_gpu_memory_fraction" in lines
    ctx = "  context_servers.kv_cache.memory_fraction = 0.02  <- "
    assert f"{ctx}free_gpu_memory_fraction (top level)" in lines
    # What the fraction gave each rank, the blocks the plan table shows.
    below = lines[lines.index(f"{ctx}free_gpu_memory_fraction (top level)") + 1]
    assert below == "    = 0.01 GiB of cache per rank, 1310 blocks"
    assert "  generation_servers.max_batch_size = 32  <- default" in lines
    assert "  context_servers.max_num_tokens = 3000  <- context_servers.max_num_tokens" in lines


def test_config_check_names_our_own_keys_as_sources(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ours.yaml"
    path.write_text(
        "model: m\nkv_cache: {block_size: 32}\nmax_batch_size: 8\n"
        "generation_servers: {kv_cache: {max_tokens: 4096}, max_batch_size: 8}\n"
    )
    code, out = _check(path, checkpoints["llama"], capsys)
    assert code == 0, out
    lines = out.splitlines()
    assert "  context_servers.kv_cache.block_size = 32  <- kv_cache.block_size (top level)" in lines
    assert (
        "  generation_servers.kv_cache.max_tokens = 4096  <- generation_servers.kv_cache.max_tokens"
        in lines
    )
    assert "  context_servers.max_batch_size = 8  <- max_batch_size (top level)" in lines
    assert "  generation_servers.max_batch_size = 8  <- generation_servers.max_batch_size" in lines


@pytest.mark.parametrize(
    ("raw", "key", "ours"),
    [
        # TensorRT-LLM's conversation router: a turn goes where its history is cached.
        (
            {"context_servers": {"router": {"type": "conversation"}}},
            "context_servers.router.type",
            ("router.type", "prefix_aware"),
        ),
        (
            {"cache_transceiver_config": {"backend": "V2"}},
            "cache_transceiver_config.backend",
            ("cache_transceiver.backend", "auto"),
        ),
        (
            {"generation_servers": {"perf_metrics_max_requests": 1000}},
            "generation_servers.perf_metrics_max_requests",
            None,
        ),
        ({"moe_config": {"backend": "CUTLASS"}}, "moe_config", None),
        (
            {"context_servers": {"use_torch_sampler": True}},
            "context_servers.use_torch_sampler",
            None,
        ),
        (
            {"context_servers": {"sampler_type": "TRTLLMSampler"}},
            "context_servers.sampler_type",
            None,
        ),
        (
            {"generation_servers": {"env_overrides": {"TLLM_BENCHMARK_REQ_QUEUES_SIZE": "64"}}},
            "generation_servers.env_overrides",
            None,
        ),
        (
            {"context_servers": {"cache_transceiver_config": {"kv_cache_bounce_size_mb": 128}}},
            "context_servers.cache_transceiver_config.kv_cache_bounce_size_mb",
            None,
        ),
        ({"gather_generation_logits": True}, "gather_generation_logits", None),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", None),
        (
            {
                "context_servers": {
                    "router": {"type": "kv_cache_aware", "track_routed_blocks": True}
                }
            },
            "context_servers.router.track_routed_blocks",
            ("router.type", "prefix_aware"),
        ),
    ],
)
def test_keys_of_tensorrt_llm_test_configs_are_served_with_a_listed_reason(
    raw: dict[str, Any], key: str, ours: tuple[str, Any] | None
) -> None:
    translation = translate({"model": "m", **raw}, "t.yaml")
    reasons = {item.key: item.reason for item in translation.ignored}
    assert key in reasons and reasons[key], translation.ignored
    if ours is not None:
        flat = _dotted(config_from_dict(translation.native).model_dump(exclude_unset=True))
        assert flat[ours[0]] == ours[1]


def test_mamba_state_config_becomes_our_snapshot_policy() -> None:
    state = {
        "periodic_snapshot_interval": 256,
        "additional_snapshot_offsets_from_start": [64, 128],
        "enable_branch_snapshot": False,
        "additional_snapshot_offsets_from_end": [],
    }
    raw = {"model": "m", "kv_cache_config": {"mamba_state_config": state}}
    flat = _dotted(config_from_dict(translate(raw, "t.yaml").native).model_dump())
    assert flat["kv_cache.snapshots.interval"] == 256
    assert flat["kv_cache.snapshots.positions"] == [64, 128]
    assert flat["kv_cache.snapshots.on_demand"] is False
    assert flat["kv_cache.snapshots.at_end"] is True
    state["additional_snapshot_offsets_from_end"] = [0]
    with pytest.raises(ConfigError, match="additional_snapshot_offsets_from_end: snapshots at"):
        translate(raw, "t.yaml")


def test_a_file_that_is_not_a_disaggregated_config_says_what_it_looks_like() -> None:
    with pytest.raises(ConfigError, match="not a `trtllm-serve disaggregated` config") as info:
        translate({"cache_transceiver_config": {"backend": "UCX"}}, "gen_extra.yml")
    assert "a worker's --extra_llm_api_options file" in str(info.value)
    etcd = {"server_type": "etcd", "hostname": "localhost", "port": 2379}
    assert is_trtllm(etcd)
    with pytest.raises(ConfigError, match="looks like a metadata server config"):
        translate(etcd, "etcd_config.yaml")


# -- speculative_config: NGram and MTP translated, every other decoding type refused --


def test_ngram_becomes_our_ngram_speculation_on_the_generation_workers(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = read_config(CONFIGS / "ngram-speculative.yaml")
    config = loaded.config.model_copy(update={"model": str(checkpoints["llama"])})
    context, generation = resolve_plan(config).instances
    assert context.speculative is None
    assert generation.speculative == SpeculativeConfig(
        "ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3
    )
    code, out = _check(CONFIGS / "ngram-speculative.yaml", checkpoints["llama"], capsys)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].endswith(
        "; speculative decoding on generation instances: ngram, 4 drafts a step from n-grams "
        "of 3 down to 1"
    )
    spec = "  generation_servers.speculative_config"
    assert f"{spec}.num_speculative_tokens = 4  <- {spec[2:]}.max_draft_len" in lines
    assert f"{spec}.prompt_lookup_max = 3  <- {spec[2:]}.max_matching_ngram_size" in lines
    assert f"{spec}.method = 'ngram'  <- {spec[2:]}.decoding_type" in lines
    assert f"{spec}.prompt_lookup_min = 1  <- {spec[2:]}.decoding_type" in lines


def test_a_top_level_ngram_block_is_inherited_and_max_matching_defaults_as_there() -> None:
    block = {"decoding_type": "NGram", "max_draft_len": 2}
    translation = translate({"model": "m", "speculative_config": block}, "t.yaml")
    assert translation.native["speculative_config"] == {
        "method": "ngram",
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,  # TensorRT-LLM's max_matching_ngram_size default
        "num_speculative_tokens": 2,
    }
    assert translation.ignored == ()
    config = config_from_dict(translation.native)
    assert config.role_settings("generation_servers").speculative_config is not None
    # Our keys in a TensorRT-LLM file are kept as ours.
    ours = _translate({"backend": "pytorch", "speculative_config": {"num_speculative_tokens": 5}})
    assert ours.speculative_config.num_speculative_tokens == 5


def test_a_speculative_config_with_a_decoding_type_marks_the_dialect() -> None:
    block = {"decoding_type": "NGram", "max_draft_len": 2}
    assert is_trtllm({"model": "m", "generation_servers": {"speculative_config": block}})
    assert not is_trtllm({"model": "m", "speculative_config": {"num_speculative_tokens": 2}})


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (
            {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "d"},
            r"speculative_config.decoding_type: Eagle3: EAGLE-3 draft heads are not available "
            r"here; use decoding_type: NGram \(prompt lookup, no draft model\) or MTP \(the "
            r"checkpoint's own MTP layers\), or remove speculative_config$",
        ),
        (
            {"decoding_type": "Guess"},
            "speculative_config.decoding_type: 'Guess' is not a decoding type; use "
            "decoding_type: NGram",
        ),
        ({"decoding_type": "NGram"}, "speculative_config: NGram needs max_draft_len"),
        ({"max_draft_len": 3}, "speculative_config: has no decoding_type; .*NGram or MTP"),
        (
            {"num_nextn_predict_layers": 2},
            "speculative_config: has no decoding_type; .*NGram or MTP",
        ),
        (
            {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram": 2},
            "speculative_config.max_matching_ngram: unknown key; did you mean "
            "'max_matching_ngram_size'",
        ),
        (
            {"decoding_type": "NGram", "max_draft_len": 0},
            r"speculative_config.max_draft_len \(our \S*num_speculative_tokens\): .* 1",
        ),
    ],
)
def test_other_decoding_types_and_bad_ngram_keys_are_refused_by_name(
    block: dict[str, Any], message: str
) -> None:
    for where, raw in (
        ("", {"speculative_config": block}),
        ("generation_servers.", {"generation_servers": {"speculative_config": block}}),
    ):
        with pytest.raises(ConfigError, match=f"t.yaml:{where}{message}"):
            _translate(raw)


def test_a_context_section_ngram_block_is_listed_as_ignored_not_translated() -> None:
    block = {"decoding_type": "NGram", "max_draft_len": 2}
    translation = translate({"model": "m", "context_servers": {"speculative_config": block}})
    assert "speculative_config" not in translation.native.get("context_servers", {})
    reasons = {item.key: item.reason for item in translation.ignored}
    assert "first token" in reasons["context_servers.speculative_config"]


def test_mtp_becomes_our_mtp_on_both_roles_with_its_drafts_a_step(
    checkpoints: dict[str, Path],
) -> None:
    # num_nextn_predict_layers is the drafts a step; TensorRT-LLM's default is 1.
    for block, drafts in (
        ({"decoding_type": "MTP", "num_nextn_predict_layers": 3}, 3),
        ({"decoding_type": "MTP"}, 1),
    ):
        translation = translate({"model": "m", "speculative_config": block}, "t.yaml")
        assert translation.native["speculative_config"] == {
            "method": "mtp",
            "num_speculative_tokens": drafts,
        }
        assert translation.ignored == ()
        config = config_from_dict(translation.native).model_copy(
            update={"model": str(checkpoints["nemotron_h_mtp"])}
        )
        mtp = SpeculativeConfig("mtp", num_speculative_tokens=drafts)
        assert [i.speculative for i in resolve_plan(config).instances] == [mtp, mtp]
    # Both sections may set it; a context section's MTP block is translated.
    block = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    sections = {
        role: {"speculative_config": block} for role in ("context_servers", "generation_servers")
    }
    translation = translate({"model": "m", **sections}, "t.yaml")
    for role in ("context_servers", "generation_servers"):
        assert translation.native[role]["speculative_config"]["method"] == "mtp"
        assert translation.key_names[f"{role}.speculative_config.num_speculative_tokens"] == (
            f"{role}.speculative_config.num_nextn_predict_layers"
        )


def test_mtp_keys_at_what_runs_here_are_ignored_and_other_values_refused() -> None:
    block = {
        "decoding_type": "MTP",
        "num_nextn_predict_layers": 2,
        "max_draft_len": 2,
        "use_relaxed_acceptance_for_thinking": False,
        "relaxed_topk": 10,
        "relaxed_delta": 0.01,
        "use_mtp_vanilla": False,
        "mtp_eagle_one_model": True,
        "max_total_draft_tokens": 2,
        "acceptance_window": 8,
    }
    translation = translate({"model": "m", "speculative_config": block}, "t.yaml")
    assert translation.native["speculative_config"] == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }
    reasons = {item.key.split(".")[-1]: item.reason for item in translation.ignored}
    assert set(reasons) == set(block) - {"decoding_type", "num_nextn_predict_layers"}
    assert reasons["use_mtp_vanilla"] == "False is TensorRT-LLM's default and what runs here"
    assert "relaxed acceptance" in reasons["relaxed_topk"]
    assert "num_nextn_predict_layers sets" in reasons["max_draft_len"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "use_relaxed_acceptance_for_thinking",
            True,
            "is True, but relaxed acceptance would keep drafts that differ from the token a "
            "step samples",
        ),
        ("use_mtp_vanilla", True, r"is True, but vanilla MTP \(one MTP module per draft\)"),
        ("mtp_eagle_one_model", False, "is False, but two-model MTP is not implemented"),
        (
            "max_draft_len",
            3,
            r"is 3, but for MTP num_nextn_predict_layers \(1\) is the drafts a step",
        ),
        ("relaxed_top_k", 3, "unknown key; did you mean 'relaxed_topk'"),
    ],
)
def test_mtp_keys_that_would_change_behaviour_are_refused_by_name(
    key: str, value: Any, message: str
) -> None:
    block = {"decoding_type": "MTP", "num_nextn_predict_layers": 1, key: value}
    for where, raw in (
        ("", {"speculative_config": block}),
        ("context_servers.", {"context_servers": {"speculative_config": block}}),
    ):
        with pytest.raises(
            ConfigError, match=f"^t.yaml:{where}speculative_config.{key}: {message}"
        ):
            _translate(raw)


def test_mtp_on_one_section_only_is_refused_naming_both() -> None:
    block = {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
    with pytest.raises(ConfigError) as info:
        _translate({"generation_servers": {"speculative_config": block}})
    assert str(info.value).startswith(
        "t.yaml: context_servers has no speculative_config but generation_servers drafts with "
        "method mtp (generation_servers.speculative_config); the MTP attention layer's KV"
    )
