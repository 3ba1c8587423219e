"""`speculative_config` in our dialect: what each role's workers are built
with, the refusals a user reads, the plan and provenance lines, and the
launcher handing it to the generation workers only (to both roles with mtp)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.config.plan import ClusterPlan, format_plan, resolve_plan
from cluster.config.provenance import format_sources
from cluster.config.reader import LoadedConfig
from cluster.config.schema import ConfigError, config_from_dict
from cluster.config.speculation import SpeculativeDecodingConfig, worker_speculation
from cluster.launch import launcher
from engine.speculation.config import SpeculativeConfig
from engine.worker_config import WorkerConfig
from kvcache.sizing import size_instance_cache
from models.hf_config import load_model_config


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder holding only config.json: enough to resolve a plan."""
    from models.embedded.configs import checkpoint_config

    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(checkpoint_config("llama", "tiny")))
    return folder


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Nemotron-H config.json with one MTP step of an attention and a MoE layer."""
    from models.embedded.configs import checkpoint_config

    folder = tmp_path_factory.mktemp("tiny-nemotron-h-mtp")
    raw = checkpoint_config("nemotron_h", "tiny")
    raw |= {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _plan(llama_dir: Path, **raw: Any) -> ClusterPlan:
    config = {"model": str(llama_dir), "cache_transceiver": {"backend": "python"}, **raw}
    return resolve_plan(config_from_dict(config), "c.yaml")


def _sources(llama_dir: Path, **raw: Any) -> list[str]:
    loaded = LoadedConfig(config_from_dict({"model": str(llama_dir), **raw}), "disagg")
    plan = resolve_plan(loaded.config)
    return [line for line in format_sources(loaded, plan).splitlines() if "speculative" in line]


def test_a_top_level_block_makes_the_generation_workers_draft_and_not_the_context_ones(
    llama_dir: Path,
) -> None:
    plan = _plan(llama_dir, speculative_config={"num_speculative_tokens": 5})
    context, generation = plan.instances
    assert context.speculative is None
    assert generation.speculative == SpeculativeConfig(
        "ngram", num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4
    )
    assert generation.worker_config("ckpt", "s", "").speculative == generation.speculative
    assert context.worker_config("ckpt", "s", "").speculative is None


def test_absent_or_null_is_off(llama_dir: Path) -> None:
    for raw in ({}, {"speculative_config": None}):
        assert all(i.speculative is None for i in _plan(llama_dir, **raw).instances)


def test_a_section_block_replaces_the_top_level_one_whole(llama_dir: Path) -> None:
    top = {"num_speculative_tokens": 5, "prompt_lookup_max": 6}
    plan = _plan(
        llama_dir,
        speculative_config=top,
        generation_servers={"speculative_config": {"prompt_lookup_min": 3}},
    )
    # Unset fields are the defaults, not the top level's: no merge.
    assert plan.instances[1].speculative == SpeculativeConfig(
        "ngram", num_speculative_tokens=3, prompt_lookup_min=3, prompt_lookup_max=4
    )
    off = _plan(llama_dir, speculative_config=top, generation_servers={"speculative_config": None})
    assert off.instances[1].speculative is None
    only_section = _plan(llama_dir, generation_servers={"speculative_config": {}})
    assert only_section.instances[1].speculative == SpeculativeConfig()


def test_an_aggregated_plan_drafts_on_its_instances_and_says_so(llama_dir: Path) -> None:
    plan = _plan(
        llama_dir,
        speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 3},
        context_servers={"num_instances": 0},
    )
    assert [i.speculative for i in plan.instances] == [SpeculativeConfig("ngram", 2, 3, 4)]
    title = format_plan(plan).splitlines()[0]
    assert title.endswith(
        "; speculative decoding on aggregated instances: ngram, 2 drafts a step from "
        "n-grams of 4 down to 3"
    )


def test_the_plan_title_names_speculation_only_when_it_is_on(llama_dir: Path) -> None:
    assert "speculative" not in format_plan(_plan(llama_dir))
    plan = _plan(llama_dir, speculative_config={"prompt_lookup_min": 4})
    table = format_plan(plan).splitlines()
    note = (
        "; speculative decoding on generation instances: ngram, 3 drafts a step from n-grams of 4"
    )
    assert table[0].endswith(note)
    assert table[1].split()[0] == "instance"  # the table itself is unchanged


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("deepseek_mtp", "method 'deepseek_mtp' is not a method here: the checkpoint's own MTP "),
        ("nemotron_h_mtp", "method 'nemotron_h_mtp' is not a method here: .* are method: mtp"),
        ("eagle", r"method 'eagle' \(EAGLE draft heads\) is not available here"),
        ("medusa", r"method 'medusa' \(Medusa heads\) is not available here"),
        ("guess", "method 'guess' is not a speculative method"),
    ],
)
def test_other_methods_are_refused_by_name_saying_what_is_available(
    method: str, message: str
) -> None:
    available = (
        "; available: method: mtp (the checkpoint's own MTP layers) or method: ngram "
        "(prompt lookup, no draft model)"
    )
    for prefix, raw in (
        ("", {"speculative_config": {"method": method}}),
        ("generation_servers.", {"generation_servers": {"speculative_config": {"method": method}}}),
    ):
        with pytest.raises(ConfigError) as info:
            config_from_dict({"model": "m", **raw}, "c.yaml")
        text = str(info.value)
        assert re.match(f"^c.yaml:{prefix}speculative_config.method: {message}", text), text
        assert text.endswith(available)


@pytest.mark.parametrize(
    ("block", "where", "message"),
    [
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "greater"),
        ({"num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens", "less"),
        ({"prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min", "greater"),
        ({"prompt_lookup_max": "four"}, "speculative_config.prompt_lookup_max", "integer"),
        (
            {"prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "speculative_config",
            r"prompt_lookup_min \(5\) is above prompt_lookup_max \(3\)",
        ),
        (
            {"num_speculative_token": 3},
            "speculative_config.num_speculative_token",
            "unknown key; did you mean 'num_speculative_tokens'",
        ),
        ({"draft": 3}, "speculative_config.draft", "unknown key; valid keys here: method, "),
    ],
)
def test_bad_values_and_unknown_keys_name_the_field(
    block: dict[str, Any], where: str, message: str
) -> None:
    for prefix, raw in (
        ("", {"speculative_config": block}),
        ("generation_servers.", {"generation_servers": {"speculative_config": block}}),
    ):
        with pytest.raises(ConfigError, match=f"^c.yaml:{prefix}{where}: .*{message}"):
            config_from_dict({"model": "m", **raw}, "c.yaml")


def test_provenance_shows_each_role_and_where_each_field_came_from(llama_dir: Path) -> None:
    lines = _sources(
        llama_dir,
        speculative_config={"num_speculative_tokens": 5},
        generation_servers={"speculative_config": {"prompt_lookup_max": 6}},
    )
    replaced = "default (generation_servers.speculative_config replaces the top-level block whole)"
    assert lines == [
        "  context_servers.speculative_config = None  <- off on context workers: they sample "
        "only a request's first token, n-gram drafting runs on the generation workers",
        f"  generation_servers.speculative_config.method = 'ngram'  <- {replaced}",
        f"  generation_servers.speculative_config.num_speculative_tokens = 3  <- {replaced}",
        f"  generation_servers.speculative_config.prompt_lookup_min = 2  <- {replaced}",
        "  generation_servers.speculative_config.prompt_lookup_max = 6  <- "
        "generation_servers.speculative_config.prompt_lookup_max",
    ]
    top = _sources(llama_dir, speculative_config={"num_speculative_tokens": 5})
    assert top[2] == (
        "  generation_servers.speculative_config.num_speculative_tokens = 5  <- "
        "speculative_config.num_speculative_tokens (top level)"
    )
    assert top[3] == "  generation_servers.speculative_config.prompt_lookup_min = 2  <- default"
    assert _sources(llama_dir) == [
        "  context_servers.speculative_config = None  <- default",
        "  generation_servers.speculative_config = None  <- default",
    ]


# -- method mtp: the checkpoint's MTP layers, on both roles -----------------


def test_mtp_runs_on_context_and_generation_workers_alike(mtp_dir: Path) -> None:
    mtp = SpeculativeConfig("mtp", num_speculative_tokens=2)
    for raw in (
        {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        {
            "context_servers": {
                "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}
            },
            "generation_servers": {
                "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}
            },
        },
    ):
        context, generation = _plan(mtp_dir, **raw).instances
        assert context.speculative == generation.speculative == mtp
        assert context.worker_config("ckpt", "s", "").speculative == mtp
    block = SpeculativeDecodingConfig(method="mtp")
    assert worker_speculation(block, "context") == worker_speculation(block, "generation")
    assert worker_speculation(block, "context") == SpeculativeConfig("mtp")
    assert worker_speculation(SpeculativeDecodingConfig(), "context") is None


def test_mtp_refuses_the_ngram_keys_by_name() -> None:
    for prefix, raw in (
        ("", {"speculative_config": {"method": "mtp", "prompt_lookup_max": 3}}),
        (
            "context_servers.",
            {
                "context_servers": {
                    "speculative_config": {
                        "method": "mtp",
                        "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3,
                    }
                }
            },
        ),
    ):
        with pytest.raises(ConfigError) as info:
            config_from_dict({"model": "m", **raw}, "c.yaml")
        keys, verb, it = (
            ("prompt_lookup_max", "belongs", "it")
            if not prefix
            else ("prompt_lookup_min and prompt_lookup_max", "belong", "them")
        )
        assert str(info.value) == (
            f"c.yaml:{prefix}speculative_config: {keys} {verb} to method ngram (the n-gram "
            f"sizes of prompt lookup); method mtp drafts with the checkpoint's MTP layers: "
            f"remove {it}"
        )


_MTP = {"method": "mtp"}
_BOTH = (
    "; the MTP attention layer's KV is part of the cache that moves from context to "
    "generation workers: give both sections method mtp, or neither"
)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"speculative_config": _MTP, "generation_servers": {"speculative_config": None}},
            "context_servers drafts with method mtp (the top-level speculative_config) but "
            "generation_servers has speculative decoding off "
            "(generation_servers.speculative_config: null)",
        ),
        (
            {"context_servers": {"speculative_config": _MTP}},
            "context_servers drafts with method mtp (context_servers.speculative_config) but "
            "generation_servers has no speculative_config",
        ),
        (
            {"speculative_config": _MTP, "context_servers": {"speculative_config": {}}},
            "context_servers drafts with method ngram (context_servers.speculative_config) "
            "but generation_servers drafts with method mtp (the top-level speculative_config)",
        ),
        (
            {"speculative_config": None, "generation_servers": {"speculative_config": _MTP}},
            "context_servers has speculative decoding off (speculative_config: null) but "
            "generation_servers drafts with method mtp (generation_servers.speculative_config)",
        ),
    ],
)
def test_sections_that_disagree_about_mtp_are_refused_naming_both(
    raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": "m", **raw}, "c.yaml")
    assert str(info.value) == f"c.yaml: {message}{_BOTH}"


def test_sections_may_differ_without_mtp_or_without_context_instances() -> None:
    ngram_differs = {
        "speculative_config": {"num_speculative_tokens": 2},
        "context_servers": {"speculative_config": None},
    }
    config_from_dict({"model": "m", **ngram_differs})
    aggregated = {
        "context_servers": {"num_instances": 0},
        "generation_servers": {"speculative_config": _MTP},
    }
    config_from_dict({"model": "m", **aggregated})


def test_mtp_on_a_checkpoint_without_mtp_layers_fails_at_plan_time(llama_dir: Path) -> None:
    for raw, key in (
        ({"speculative_config": _MTP}, "speculative_config.method"),
        (
            {
                "context_servers": {"num_instances": 0},
                "generation_servers": {"speculative_config": _MTP},
            },
            "generation_servers.speculative_config.method",
        ),
    ):
        with pytest.raises(ConfigError) as info:
            _plan(llama_dir, **raw)
        assert str(info.value) == (
            f"c.yaml:{key}: mtp needs a checkpoint with MTP layers; {llama_dir}/config.json "
            "has num_nextn_predict_layers 0 (use method: ngram, or a checkpoint that ships "
            "its mtp.* layers)"
        )


def test_mtp_and_ngram_run_on_tensor_parallel_instances(mtp_dir: Path) -> None:
    raw = {"speculative_config": _MTP, "context_servers": {"tensor_parallel_size": 2}}
    plan = _plan(mtp_dir, **raw)
    assert plan.uses_mtp and plan.instances[0].tensor_parallel_size == 2
    ngram = {"speculative_config": {}, "generation_servers": {"tensor_parallel_size": 2}}
    assert _plan(mtp_dir, **ngram).instances[1].tensor_parallel_size == 2


def test_the_mtp_cache_counts_the_mtp_attention_layer(mtp_dir: Path) -> None:
    budget = {"kv_cache": {"cpu_memory_bytes": 64 << 20}}
    off = _plan(mtp_dir, **budget).instances
    on = _plan(mtp_dir, speculative_config=_MTP, **budget).instances
    model_config = load_model_config(mtp_dir)
    with_mtp = replace(model_config, use_mtp=True).cache_spec()
    assert len(with_mtp.attention_layers) == len(model_config.cache_spec().attention_layers) + 1
    expected = size_instance_cache(
        with_mtp,
        block_size=16,
        model_len=model_config.max_position_embeddings,
        max_batch_size=32,
        memory_bytes=64 << 20,
        verify_depth=3,
    )
    for before, after in zip(off, on, strict=True):
        assert after.num_blocks == expected.num_blocks
        assert after.num_blocks is not None and before.num_blocks is not None
        assert after.num_blocks < before.num_blocks
    # With a token budget the blocks stay; the bytes grow by the MTP layer's KV.
    tokens = {"kv_cache": {"max_tokens": 1024}}
    plain, mtp = _plan(mtp_dir, **tokens), _plan(mtp_dir, speculative_config=_MTP, **tokens)
    assert [i.num_blocks for i in plain.instances] == [i.num_blocks for i in mtp.instances]


def test_the_plan_title_says_mtp_drafts_on_both_roles(mtp_dir: Path) -> None:
    title = format_plan(_plan(mtp_dir, speculative_config=_MTP)).splitlines()[0]
    assert title.endswith(
        "; speculative decoding on context and generation instances: mtp, 3 drafts a step "
        "from the checkpoint's MTP layers (context instances send the first drafts with the "
        "first token)"
    )
    aggregated = _plan(
        mtp_dir,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        context_servers={"num_instances": 0},
    )
    assert (
        format_plan(aggregated)
        .splitlines()[0]
        .endswith(
            "; speculative decoding on aggregated instances: mtp, 1 draft a step from the "
            "checkpoint's MTP layers"
        )
    )


def test_provenance_says_context_workers_draft_with_mtp(mtp_dir: Path) -> None:
    lines = _sources(mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    top = "(top level)"
    assert lines == [
        f"  context_servers.speculative_config.method = 'mtp'  <- speculative_config.method {top}; "
        "context workers run the MTP layers too and send the first drafts with the first token",
        "  context_servers.speculative_config.num_speculative_tokens = 2  <- "
        f"speculative_config.num_speculative_tokens {top}",
        f"  generation_servers.speculative_config.method = 'mtp'  <- speculative_config.method {top}",
        "  generation_servers.speculative_config.num_speculative_tokens = 2  <- "
        f"speculative_config.num_speculative_tokens {top}",
    ]


# -- the launcher: what each actor is constructed with ----------------------


class _Call:
    def __init__(self, value: Any) -> None:
        self.value = value

    def remote(self) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(self.value)
        return future


class _ActorClass:
    """Stands in for `ray.remote(ContextWorker | GenerationWorker)`."""

    def __init__(self, built: dict[str, WorkerConfig]) -> None:
        self.built = built

    def options(self, **options: Any) -> _ActorClass:
        return self

    def remote(self, config: WorkerConfig, name: str, *role: str) -> Any:
        self.built[name] = config
        return SimpleNamespace(
            start=_Call(None), health=_Call(SimpleNamespace(healthy=True, detail=""))
        )


class _Group:
    async def ready(self) -> None:
        return None


class _Shipping:
    async def source_for(self, node_id: str) -> None:
        return None


async def test_the_launcher_passes_speculation_to_generation_workers_only(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: dict[str, WorkerConfig] = {}
    monkeypatch.setattr(launcher, "_actor_class", lambda role: _ActorClass(built))
    monkeypatch.setattr(launcher, "placement_group", lambda *args, **kwargs: _Group())
    monkeypatch.setattr(launcher, "_node_of", lambda group: ("node-0", "127.0.0.1"))
    plan = _plan(
        llama_dir,
        speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1},
        generation_servers={"num_instances": 2},
    )
    cluster = launcher.RunningCluster(plan)
    await launcher._start_all(plan, "secret", _Shipping(), cluster)  # type: ignore[arg-type]
    drafting = SpeculativeConfig("ngram", 4, 1, 4)
    assert {name: config.speculative for name, config in built.items()} == {
        "context-0": None,
        "generation-0": drafting,
        "generation-1": drafting,
    }


async def test_the_launcher_passes_mtp_to_context_workers_too(
    mtp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: dict[str, WorkerConfig] = {}
    monkeypatch.setattr(launcher, "_actor_class", lambda role: _ActorClass(built))
    monkeypatch.setattr(launcher, "placement_group", lambda *args, **kwargs: _Group())
    monkeypatch.setattr(launcher, "_node_of", lambda group: ("node-0", "127.0.0.1"))
    plan = _plan(mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    cluster = launcher.RunningCluster(plan)
    await launcher._start_all(plan, "secret", _Shipping(), cluster)  # type: ignore[arg-type]
    drafting = SpeculativeConfig("mtp", 2)
    assert {name: config.speculative for name, config in built.items()} == {
        "context-0": drafting,
        "generation-0": drafting,
    }
