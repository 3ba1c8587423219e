"""The disagg YAML config: validation errors a user would read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.config.plan import format_plan, resolve_plan
from cluster.config.reader import load_config
from cluster.config.schema import ConfigError, config_from_dict


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_unknown_key_names_file_key_and_suggests_the_closest(tmp_path: Path) -> None:
    path = _write(tmp_path, "model: m\nkv_cache:\n  blok_size: 32\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path}:kv_cache.blok_size" in message
    assert "did you mean 'block_size'" in message


def test_unknown_key_inside_a_section_suggests_from_that_section() -> None:
    with pytest.raises(ConfigError, match="context_servers.num_instance: .*'num_instances'"):
        config_from_dict({"model": "m", "context_servers": {"num_instance": 2}})


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match="valid keys here: .*backend"):
        config_from_dict({"model": "m", "cache_transceiver": {"zzz": 1}})


def test_conflicting_top_level_and_section_values_name_both_places() -> None:
    raw = {
        "model": "m",
        "kv_cache": {"block_size": 16},
        "generation_servers": {"kv_cache": {"block_size": 32}},
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    message = str(info.value)
    assert "kv_cache.block_size is 16 at the top level" in message
    assert "generation_servers.kv_cache.block_size is 32" in message


def test_equal_values_in_both_places_are_accepted() -> None:
    raw = {"model": "m", "max_batch_size": 8, "context_servers": {"max_batch_size": 8}}
    assert config_from_dict(raw).role_settings("context_servers").max_batch_size == 8


def test_section_overrides_a_default_left_unset_at_top_level() -> None:
    raw = {
        "model": "m",
        "kv_cache": {"memory_fraction": 0.5, "block_size": 8},
        "generation_servers": {"kv_cache": {"max_tokens": 4096}},
    }
    config = config_from_dict(raw)
    generation = config.role_settings("generation_servers").kv_cache
    context = config.role_settings("context_servers").kv_cache
    assert (generation.max_tokens, generation.memory_fraction, generation.block_size) == (
        4096,
        None,
        8,
    )
    assert (context.max_tokens, context.memory_fraction) == (None, 0.5)


def test_tensor_parallel_on_either_section_needs_a_gpu_per_rank() -> None:
    for section in ("context_servers", "generation_servers"):
        config = config_from_dict({"model": "m", section: {"tensor_parallel_size": 2}})
        assert config.role_settings(section).tensor_parallel_size == 2
        with pytest.raises(ConfigError, match=f"{section}.num_gpus is 0.5 .* each rank needs"):
            config_from_dict({"model": "m", section: {"tensor_parallel_size": 2, "num_gpus": 0.5}})


def test_both_cache_sizing_keys_is_an_error() -> None:
    with pytest.raises(ConfigError, match="max_tokens or kv_cache.memory_fraction, not both"):
        config_from_dict({"model": "m", "kv_cache": {"max_tokens": 64, "memory_fraction": 0.2}})


def test_bad_enum_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match="router.type: .*prefix_aware"):
        config_from_dict({"model": "m", "router": {"type": "random"}})
    with pytest.raises(ConfigError, match="router.first_token_at: .*admission"):
        config_from_dict({"model": "m", "router": {"first_token_at": "decode"}})


def test_the_stall_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="router.stall_timeout_s"):
        config_from_dict({"model": "m", "router": {"stall_timeout_s": 0}})
    config = config_from_dict({"model": "m", "router": {"stall_timeout_s": 5}})
    assert config.router.stall_timeout_s == 5.0


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "model: m\nkv_cache:\n  block_size: 16\n  max_tokens: 64\n  block_size: 32\n"
    )
    with pytest.raises(ConfigError, match="key 'block_size' is set twice, on lines 3 and 5"):
        load_config(path)
    # The same key in two different mappings is two keys.
    both = _write(
        tmp_path,
        "model: m\nkv_cache: {block_size: 16}\ncontext_servers:\n  kv_cache: {block_size: 16}\n",
    )
    assert load_config(both).kv_cache.block_size == 16


def test_missing_file_and_non_mapping_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder holding only config.json: enough to resolve a plan."""
    from models.embedded.configs import checkpoint_config

    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(checkpoint_config("llama", "tiny")))
    return folder


def test_nixl_with_v1_and_v2_forced_is_one_message_before_anything_starts(
    llama_dir: Path,
) -> None:
    raw = {
        "model": str(llama_dir),
        "cache_transceiver": {"backend": "nixl"},
        "context_servers": {"kv_cache": {"manager": "v1"}},
        "generation_servers": {"kv_cache": {"manager": "v2"}},
    }
    ray_was_up = ray.is_initialized()  # another module of the suite may have started it
    with pytest.raises(ConfigError) as info:
        resolve_plan(config_from_dict(raw), "c.yaml")
    message = str(info.value)
    assert message.count("\n") == 0
    assert "'v1' on context_servers but 'v2' on generation_servers" in message
    assert "NIXL" in message
    assert ray.is_initialized() == ray_was_up


def test_nixl_with_one_side_forced_resolves_both_sides_to_it(llama_dir: Path) -> None:
    raw = {
        "model": str(llama_dir),
        "cache_transceiver": {"backend": "nixl"},
        "generation_servers": {"kv_cache": {"manager": "v2"}},
    }
    plan = resolve_plan(config_from_dict(raw))
    assert {i.manager for i in plan.instances} == {"v2"}


def test_python_transceiver_may_bridge_v1_and_v2(llama_dir: Path) -> None:
    raw = {
        "model": str(llama_dir),
        "cache_transceiver": {"backend": "python"},
        "context_servers": {"kv_cache": {"manager": "v1"}, "num_instances": 2},
        "generation_servers": {"kv_cache": {"manager": "v2"}},
    }
    plan = resolve_plan(config_from_dict(raw))
    assert [(i.name, i.manager) for i in plan.instances] == [
        ("context-0", "v1"),
        ("context-1", "v1"),
        ("generation-0", "v2"),
    ]


def test_plan_sizes_blocks_and_prints_a_table(llama_dir: Path) -> None:
    raw = {
        "model": str(llama_dir),
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"block_size": 8, "enable_block_reuse": True},
        "context_servers": {"kv_cache": {"max_tokens": 1000}},
        "generation_servers": {"kv_cache": {"max_tokens": 64}},
    }
    plan = resolve_plan(config_from_dict(raw))
    context, generation = plan.instances
    # usable blocks plus the permanent null block
    assert (context.num_blocks, generation.num_blocks) == (126, 9)
    assert context.manager == "v1" and not context.enable_block_reuse  # reuse needs V2
    assert plan.max_model_len == 64  # the smallest cache bounds a request
    table = format_plan(plan).splitlines()
    assert table[1].split() == [
        "instance", "role", "manager", "transceiver", "block", "blocks", "slots", "device", "cpus"
    ]  # fmt: skip
    assert table[3].split() == [
        "generation-0", "generation", "v1", "python", "8", "9", "0", "cpu", "1"
    ]  # fmt: skip


def test_no_context_instances_is_an_aggregated_only_plan(llama_dir: Path) -> None:
    raw = {
        "model": str(llama_dir),
        "cache_transceiver": {"backend": "nixl"},  # nothing moves: not even checked
        "context_servers": {"num_instances": 0},
        "generation_servers": {"num_instances": 2, "kv_cache": {"max_tokens": 64}},
    }
    plan = resolve_plan(config_from_dict(raw))
    assert plan.aggregated_only and [i.worker_role for i in plan.instances] == ["aggregated"] * 2
    assert plan.transceiver == "none"
    table = format_plan(plan).splitlines()
    assert "aggregated only" in table[0] and "every request runs whole" in table[0]
    assert [row.split()[:4] for row in table[2:]] == [
        ["generation-0", "aggregated", "v1", "none"],
        ["generation-1", "aggregated", "v1", "none"],
    ]


def test_generation_servers_cannot_be_empty() -> None:
    with pytest.raises(ConfigError, match="generation_servers.num_instances is 0.*1 or more"):
        config_from_dict({"model": "m", "generation_servers": {"num_instances": 0}})


def test_num_cpus_per_section_reaches_every_instance_and_the_ray_size(llama_dir: Path) -> None:
    raw = {
        "model": str(llama_dir),
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"max_tokens": 64},
        "context_servers": {"num_cpus": 2},
        "generation_servers": {"num_instances": 2, "num_cpus": 0.5},
    }
    plan = resolve_plan(config_from_dict(raw))
    assert [i.num_cpus for i in plan.instances] == [2.0, 0.5, 0.5]
    assert plan.num_cpus == 3.0
    assert [row.split()[-1] for row in format_plan(plan).splitlines()[2:]] == ["2", "0.5", "0.5"]
    with pytest.raises(ConfigError, match="num_cpus"):
        config_from_dict({"model": "m", "context_servers": {"num_cpus": 0}})


def test_cpu_affinity_gives_each_instance_its_own_group_of_cpus(llama_dir: Path) -> None:
    raw = {
        "model": str(llama_dir),
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"max_tokens": 64},
        "context_servers": {"cpu_affinity": [0]},
        "generation_servers": {"num_instances": 2, "num_cpus": 2, "cpu_affinity": [4, 5, 2, 3]},
    }
    plan = resolve_plan(config_from_dict(raw))
    assert [i.cpu_affinity for i in plan.instances] == [(0,), (4, 5), (2, 3)]
    assert plan.instances[2].worker_config("ckpt", "s", "").cpu_affinity == (2, 3)
    assert format_plan(plan).splitlines()[-1].endswith("2 on 2,3")
    unpinned = resolve_plan(config_from_dict(raw | {"context_servers": {}}))
    assert unpinned.instances[0].cpu_affinity == ()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"num_instances": 2, "cpu_affinity": [0]}, "lists 1 CPUs, but its 2 instance.* need 2"),
        ({"num_cpus": 1.5, "cpu_affinity": [0]}, "num_cpus a whole number"),
        ({"cpu_affinity": [1, 1]}, "distinct CPU ids"),
        ({"cpu_affinity": [-1]}, "distinct CPU ids"),
        ({"tensor_parallel_size": 2, "num_gpus": 1, "cpu_affinity": [0]}, "single-rank"),
    ],
)
def test_cpu_affinity_that_cannot_pin_every_instance_is_refused(
    section: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": "m", "generation_servers": section})


def test_a_cpu_memory_fraction_sizes_from_each_rank_share_of_the_host(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("cluster.config.plan.host_available_bytes", lambda: 96 << 20)
    raw: dict[str, Any] = {
        "model": str(llama_dir),
        "context_servers": {"kv_cache": {"memory_fraction": 0.5}},
        "generation_servers": {"kv_cache": {"memory_fraction": 0.25}},
    }
    plan = resolve_plan(config_from_dict(raw))
    # Two CPU ranks share the host's 96 MiB: 48 MiB each, then each role's fraction.
    assert [i.kv_cache_memory_bytes for i in plan.instances] == [24 << 20, 12 << 20]
    assert plan.instances[0].num_blocks == 2 * plan.instances[1].num_blocks
    raw["context_servers"]["num_instances"] = 2
    plan = resolve_plan(config_from_dict(raw))
    assert [i.kv_cache_memory_bytes for i in plan.instances] == [16 << 20, 16 << 20, 8 << 20]
    # A stated CPU budget is what the fraction applies to, as before.
    raw = {
        "model": str(llama_dir),
        "kv_cache": {"memory_fraction": 0.5, "cpu_memory_bytes": 1 << 23},
    }
    plan = resolve_plan(config_from_dict(raw))
    assert all(i.kv_cache_memory_bytes == 1 << 22 and i.num_blocks for i in plan.instances)


def test_host_available_bytes_is_within_the_physical_memory() -> None:
    from kvcache.sizing import host_available_bytes

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < host_available_bytes() <= physical


def test_a_cache_too_small_for_one_sequence_names_the_role(llama_dir: Path) -> None:
    raw = {"model": str(llama_dir), "generation_servers": {"kv_cache": {"cpu_memory_bytes": 4096}}}
    with pytest.raises(ConfigError, match="generation_servers.kv_cache: KV cache budget"):
        resolve_plan(config_from_dict(raw))


def test_missing_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="c.yaml:model: .* is not a local folder or file"):
        resolve_plan(config_from_dict({"model": str(tmp_path / "nope")}), "c.yaml")


def test_serve_refuses_a_conflicting_config_before_starting_ray(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.cli import main

    path = _write(
        tmp_path,
        f"model: {llama_dir}\n"
        "cache_transceiver: {backend: nixl}\n"
        "context_servers: {kv_cache: {manager: v1}}\n"
        "generation_servers: {kv_cache: {manager: v2}}\n",
    )
    ray_was_up = ray.is_initialized()
    assert main(["serve", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: kv_cache.manager is 'v1' on context_servers")
    assert ray.is_initialized() == ray_was_up


def test_section_resources_place_roles_and_refuse_what_ray_sizes_itself() -> None:
    config = config_from_dict({"model": "m", "context_servers": {"resources": {"prefill": 1}}})
    assert config.role_settings("context_servers").resources == {"prefill": 1}
    assert config.role_settings("generation_servers").resources == {}
    with pytest.raises(ConfigError, match="'GPU', which Ray sizes itself; set num_gpus"):
        config_from_dict({"model": "m", "generation_servers": {"resources": {"GPU": 1}}})
    with pytest.raises(ConfigError, match="resources.decode is 0"):
        config_from_dict({"model": "m", "generation_servers": {"resources": {"decode": 0}}})


def test_a_missing_example_checkpoint_says_how_to_write_it_not_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    cases = {
        "checkpoints/tiny-llama": "`disagg make-checkpoint --arch llama checkpoints/tiny-llama`",
        "checkpoints/mini-nemotron-h": "--arch nemotron_h --size mini checkpoints/mini-nemotron-h",
        "models/absent": f"no such path under {tmp_path}",
        "./absent": f"no such path under {tmp_path}",
    }
    for model, message in cases.items():
        with pytest.raises(ConfigError) as info:
            resolve_plan(config_from_dict({"model": model}, source="c.yaml"))
        assert message in str(info.value) and "Hub id" not in str(info.value), model
    with pytest.raises(ConfigError, match="looks like a Hugging Face Hub id"):
        resolve_plan(config_from_dict({"model": "org/some-model"}, source="c.yaml"))
    # An absolute path is not under the working directory.
    with pytest.raises(ConfigError) as info:
        resolve_plan(config_from_dict({"model": str(tmp_path / "gone")}, source="c.yaml"))
    assert str(info.value).endswith("is not a local folder or file: no such path")


def test_errors_about_a_model_given_by_flag_name_the_flag(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.cli import main

    missing = str(tmp_path / "absent")
    config = _write(tmp_path, f"model: {llama_dir}\n")
    for argv in (["serve", "--model", missing], ["serve", "-c", str(config), "--model", missing]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --model: {missing!r} is not a local folder"), err
        assert "<embedded default>" not in err and str(config) not in err
    # Named by the file, the file's key is named.
    assert main(["serve", "-c", str(_write(tmp_path, f"model: {missing}\n"))]) == 2
    assert capsys.readouterr().err.startswith(f"error: {config}:model: {missing!r}")
