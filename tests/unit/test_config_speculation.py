"""`speculative_config` in our dialect: what each role's workers are built
with, the refusals a user reads, the plan and provenance lines, and the
launcher handing it to the generation workers only."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.config.plan import ClusterPlan, format_plan, resolve_plan
from cluster.config.provenance import format_sources
from cluster.config.schema import ConfigError, LoadedConfig, config_from_dict
from cluster.launch import launcher
from engine.speculation.config import SpeculativeConfig
from engine.worker_config import WorkerConfig


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder holding only config.json: enough to resolve a plan."""
    from models.embedded.configs import checkpoint_config

    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(checkpoint_config("llama", "tiny")))
    return folder


def _plan(llama_dir: Path, **raw: Any) -> ClusterPlan:
    config = {"model": str(llama_dir), "cache_transceiver": {"backend": "python"}, **raw}
    return resolve_plan(config_from_dict(config))


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


def test_mtp_is_refused_saying_it_is_not_in_this_build() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": "m", "speculative_config": {"method": "mtp"}}, "c.yaml")
    message = str(info.value)
    assert message.startswith("c.yaml:speculative_config.method: method 'mtp': ")
    assert "Nemotron-H MTP drafting is not available in this build; use method: ngram" in message
    section = {"generation_servers": {"speculative_config": {"method": "eagle"}}}
    with pytest.raises(
        ConfigError, match="generation_servers.speculative_config.method: method 'eagle' is not "
    ):
        config_from_dict({"model": "m", **section})


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
        "only a request's first token, drafting runs on the generation workers",
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
