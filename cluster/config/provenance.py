"""Where each effective setting of a role came from: its section, the top
level, or the default; in a translated file, the key the file wrote.

`disagg config check` prints these lines under the plan, so an operator can
see which of two places that could set a value actually did:

    generation_servers.kv_cache.memory_fraction = 0.05
        from generation_servers.kv_cache_config.free_gpu_memory_fraction
        (1.0 GiB of the 20.4 GiB this host gives each CPU rank)
    generation_servers.speculative_config.num_speculative_tokens = 4
        from generation_servers.speculative_config.max_draft_len
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.config.plan import ClusterPlan
from cluster.config.reader import LoadedConfig
from cluster.config.schema import ROLES, ClusterConfig, ServerSectionConfig, speculation_origin
from cluster.config.speculation import (
    CONTEXT_DOES_NOT_DRAFT,
    CONTEXT_DRAFTS_MTP,
    SpeculativeDecodingConfig,
)

# Settings a section takes from its own keys only.
SECTION_ONLY = ("num_instances", "tensor_parallel_size", "num_gpus", "num_cpus")
# (block, field): a section's block overrides the top-level one field by field.
NESTED = (
    ("kv_cache", "manager"),
    ("kv_cache", "block_size"),
    ("kv_cache", "enable_block_reuse"),
    ("kv_cache", "max_tokens"),
    ("kv_cache", "memory_fraction"),
    ("kv_cache", "cpu_memory_bytes"),
    ("cache_transceiver", "backend"),
    ("cache_transceiver", "wire"),
    ("cache_transceiver", "timeout_s"),
)
# Scalars a section may override.
SCALARS = ("max_num_tokens", "max_batch_size")
_GIB = 1 << 30


@dataclass(frozen=True)
class Source:
    setting: str  # ours, dotted under the section: "generation_servers.kv_cache.block_size"
    value: Any
    origin: str  # the key as the file wrote it, or "default"


def setting_sources(loaded: LoadedConfig) -> list[Source]:
    """Every tracked setting of both roles whose effective value is set."""
    config = loaded.config
    rows: list[Source] = []
    for role in ROLES:
        section: ServerSectionConfig = getattr(config, role)
        settings = config.role_settings(role)
        for name in SECTION_ONLY:
            origin = f"{role}.{name}" if name in section.model_fields_set else None
            rows.append(_row(loaded, role, name, getattr(settings, name), origin))
        for block, name in NESTED:
            value = getattr(getattr(settings, block), name)
            if value is None:
                continue
            rows.append(
                _row(loaded, role, f"{block}.{name}", value, _nested(config, role, block, name))
            )
        for name in SCALARS:
            origin = _scalar(config, section, role, name)
            rows.append(_row(loaded, role, name, getattr(settings, name), origin))
        rows += _speculation(loaded, role, settings.speculative_config)
    return rows


def format_sources(loaded: LoadedConfig, plan: ClusterPlan) -> str:
    """The lines `disagg config check` prints: each setting, its origin, and
    for a memory fraction the bytes it gave each instance."""
    lines = ["effective settings per role, and the key each came from:"]
    for row in setting_sources(loaded):
        lines.append(f"  {row.setting} = {row.value!r}  <- {row.origin}")
        if row.setting.endswith("kv_cache.memory_fraction"):
            lines += _fraction_sizes(plan, row.setting.split(".")[0])
    return "\n".join(lines)


def _row(loaded: LoadedConfig, role: str, name: str, value: Any, origin: str | None) -> Source:
    setting = f"{role}.{name}"
    if origin is None:
        return Source(setting, value, "default")
    written = loaded.key_names.get(origin, origin)
    if written.split(".")[0] not in ROLES:
        written += " (top level)"
    return Source(setting, value, written)


def _speculation(
    loaded: LoadedConfig, role: str, block: SpeculativeDecodingConfig | None
) -> list[Source]:
    """One row when the role does not draft, else one per field its method
    reads. The block is the section's when it sets one, else the top level's,
    whole: a field it leaves out is the default, never the other block's.
    With mtp a context section's rows say that its workers draft too."""
    origin = speculation_origin(loaded.config, role)
    if block is not None and role == "context_servers" and not block.uses_model:
        return [Source(f"{role}.speculative_config", None, CONTEXT_DOES_NOT_DRAFT)]
    if block is None:
        return [_row(loaded, role, "speculative_config", None, origin)]
    replaced = origin != "speculative_config" and loaded.config.speculative_config is not None
    rows = []
    for name in block.drafted_fields():
        value = getattr(block, name)
        if name in block.model_fields_set:
            rows.append(_row(loaded, role, f"speculative_config.{name}", value, f"{origin}.{name}"))
        elif replaced:
            why = f"default ({origin} replaces the top-level block whole)"
            rows.append(Source(f"{role}.speculative_config.{name}", value, why))
        else:
            rows.append(_row(loaded, role, f"speculative_config.{name}", value, None))
    if role == "context_servers":  # drafting there means mtp
        rows[0] = Source(rows[0].setting, rows[0].value, f"{rows[0].origin}; {CONTEXT_DRAFTS_MTP}")
    return rows


def _nested(config: ClusterConfig, role: str, block: str, name: str) -> str | None:
    override = getattr(getattr(config, role), block)
    if override is not None and name in override.model_fields_set:
        return f"{role}.{block}.{name}"
    if name in getattr(config, block).model_fields_set:
        return f"{block}.{name}"
    return None


def _scalar(
    config: ClusterConfig, section: ServerSectionConfig, role: str, name: str
) -> str | None:
    if name in section.model_fields_set and getattr(section, name) is not None:
        return f"{role}.{name}"
    return name if name in config.model_fields_set else None


def _fraction_sizes(plan: ClusterPlan, role: str) -> list[str]:
    instances = plan.of_role(role.removesuffix("_servers"))
    if not instances:
        return []
    first = instances[0]
    if first.kv_cache_memory_bytes is None:
        return ["    (of each instance's GPU share, measured by the worker after its weights load)"]
    blocks = "" if first.num_blocks is None else f", {first.num_blocks} blocks"
    return [f"    = {first.kv_cache_memory_bytes / _GIB:.2f} GiB of cache per rank{blocks}"]
