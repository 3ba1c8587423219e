"""Reading a config file of either dialect: ours (`cluster.config.schema`)
or TensorRT-LLM's `trtllm-serve disaggregated` YAML, translated once
(`cluster.config.trtllm`). The one module that knows both, so neither
imports the other's reader."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.config import trtllm
from cluster.config.schema import ClusterConfig, ConfigError, config_from_dict


@dataclass(frozen=True)
class LoadedConfig:
    """A config file as read: the validated config, the dialect it was written
    in ("disagg" or "tensorrt-llm"), the keys that were read but do not
    apply here, each with its reason (`key: reason`), and, for a translated
    file, which key it wrote for each of our dotted keys."""

    config: ClusterConfig
    dialect: str
    ignored: tuple[str, ...] = ()
    key_names: Mapping[str, str] = dataclasses.field(default_factory=dict)


class _DuplicateKey(yaml.YAMLError):
    """A mapping sets one key twice (plain YAML keeps the last silently)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise _DuplicateKey(
                    f"key {key!r} is set twice, on lines {lines[key]} and {line}; keep one"
                )
            lines[key] = line
        return super().construct_mapping(node, deep)


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate a disagg YAML file; raises `ConfigError` naming file:key."""
    return read_config(path).config


def read_config(path: str | Path) -> LoadedConfig:
    """Read a config file of either dialect: ours, or TensorRT-LLM's
    `trtllm-serve disaggregated` YAML (recognized by its keys and translated
    once, here, by `cluster.config.trtllm`). Raises `ConfigError`."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from exc
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys, got {type(raw).__name__}")
    if not trtllm.is_trtllm(raw):
        return LoadedConfig(config_from_dict(raw, source=str(path)), "disagg")
    translation = trtllm.translate(raw, source=str(path))
    config = config_from_dict(translation.native, str(path), translation.key_names)
    ignored = tuple(str(item) for item in translation.ignored)
    return LoadedConfig(config, trtllm.DIALECT, ignored, translation.key_names)
