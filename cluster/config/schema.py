"""The disagg YAML config: what an operator writes to describe a cluster.

Top-level keys are defaults for both `context_servers` and
`generation_servers`; a section may override the kv_cache, cache_transceiver
and scheduler keys for its role. Setting one key to two *different* values at
the top level and in a section is an error, because the reader cannot tell
which one wins. `speculative_config` is the exception: a section's block (or
`null`, off) replaces the top-level one whole for that section, because one
block describes one drafting method and its fields mean something only
together; with method mtp both sections must use it (its attention KV is
part of the cache that moves between them). `auto` values stay `auto`
here; `cluster.config.plan.resolve_plan` resolves them once at startup.

    model: checkpoints/tiny-llama
    port: 8000
    router: {type: prefix_aware}
    kv_cache: {manager: auto, block_size: 16, max_tokens: 8192}
    context_servers: {num_instances: 2}
    generation_servers: {num_instances: 1, kv_cache: {max_tokens: 16384}}
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.config.speculation import SpeculativeDecodingConfig, mtp_roles_disagree
from transfer.python.ucx_wire import UCX_INSTALL_HINT, ucx_importable

ROLES = ("context_servers", "generation_servers")
# Keys a server section may override; each must also exist at the top level.
SECTION_OVERRIDES = ("kv_cache", "cache_transceiver", "max_num_tokens", "max_batch_size")
SIZING_KEYS = ("max_tokens", "memory_fraction")


class ConfigError(ValueError):
    """A disagg config the cluster cannot run; the message names file and key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RouterConfig(_Strict):
    type: Literal["round_robin", "least_loaded", "prefix_aware"] = "round_robin"
    # Completions the server holds at once (running or waiting on a worker);
    # past it new requests get 429 with Retry-After instead of queueing.
    max_queued_requests: int = Field(default=256, gt=0)
    # When a disaggregated request's first token (sampled by the context
    # worker) goes to the client: "prefill" at once, before its cache moves
    # (the transfer then sits between the first and second token); "admission"
    # once the generation worker has the cache and admits the request (the
    # transfer is part of TTFT and every later gap is one decode step).
    first_token_at: Literal["prefill", "admission"] = "admission"
    # A worker that answers no poll for this many seconds (a stopped process,
    # a blocked event loop, a node cut off that Ray has not declared dead)
    # has its requests moved: a prefill runs on another context worker, a
    # generation request that streamed nothing runs again elsewhere, one that
    # streamed ends with an error naming the worker. It gets requests again
    # once it answers a poll.
    stall_timeout_s: float = Field(default=30.0, gt=0)


class ConditionalDisaggConfig(_Strict):
    # A prompt of at most this many tokens runs whole on a generation worker;
    # 0 sends every request through a context worker.
    max_local_prefill_length: int = Field(default=0, ge=0)


class CacheTransceiverConfig(_Strict):
    """How caches move. `wire` is the Python backend's transport: "tcp"
    (default), "ucx" (needs the `ucx` extra on every node), or "auto" (UCX
    where `ucxx` imports on the worker's node, else TCP). A puller dials the
    wire the holder's handle names, so the two roles need not agree.
    `pipelined_transfer`: a prompt longer than a context prefill chunk is
    pulled chunk by chunk while it prefills (off: in one pull after it)."""

    backend: Literal["auto", "nixl", "python"] = "auto"
    wire: Literal["tcp", "ucx", "auto"] = "tcp"
    timeout_s: float = Field(default=30.0, gt=0)
    lease_s: float = Field(default=60.0, gt=0)
    pipelined_transfer: bool = True

    @field_validator("wire")
    @classmethod
    def _ucx_is_installed(cls, value: str) -> str:
        if value == "ucx" and not ucx_importable():
            raise ValueError(
                "cache_transceiver.wire is 'ucx' but the ucxx package is not installed; "
                f"run {UCX_INSTALL_HINT} on every node, or set wire to 'tcp' or 'auto'"
            )
        return value


class SnapshotsConfig(_Strict):
    """Mamba state snapshots, what block reuse on a hybrid model resumes from.

    interval: every this many tokens of a sequence (a multiple of the block
    size; 0: none). positions: fixed token positions (multiples of the block
    size). at_end: the live state of every sequence that ends (the next turn
    of a conversation resumes right after it). on_demand: where a prompt's
    cached KV runs a block or more past its last snapshot (a shared prefix).
    num_slots: snapshots kept at once, each the size of one running request's
    Mamba state; None: max_batch_size.
    """

    interval: int = Field(default=0, ge=0)
    positions: list[int] = Field(default_factory=list)
    at_end: bool = True
    on_demand: bool = True
    num_slots: int | None = Field(default=None, ge=0)


class KvCacheConfig(_Strict):
    """Cache manager choice and size. Give `max_tokens` or `memory_fraction`, not both."""

    manager: Literal["auto", "v1", "v2"] = "auto"
    block_size: int = Field(default=16, gt=0)
    enable_block_reuse: bool = False
    max_tokens: int | None = Field(default=None, gt=0)
    memory_fraction: float | None = Field(default=None, gt=0, le=1)
    cpu_memory_bytes: int | None = Field(default=None, gt=0)
    snapshots: SnapshotsConfig = Field(default_factory=SnapshotsConfig)

    @model_validator(mode="after")
    def _one_sizing_key(self) -> KvCacheConfig:
        if self.max_tokens is not None and self.memory_fraction is not None:
            raise ValueError("set kv_cache.max_tokens or kv_cache.memory_fraction, not both")
        snapshots = self.snapshots
        off_grid = [p for p in (snapshots.interval, *snapshots.positions) if p % self.block_size]
        if off_grid:
            raise ValueError(
                f"kv_cache.snapshots interval and positions must be multiples of "
                f"kv_cache.block_size ({self.block_size}), got {off_grid}"
            )
        return self


class ServerSectionConfig(_Strict):
    """One role's instances; unset override keys inherit the top level."""

    # 0 context instances: every request runs whole on a generation instance.
    num_instances: int = Field(default=1, ge=0)
    tensor_parallel_size: int = Field(default=1, ge=1)
    num_gpus: float = Field(default=0.0, ge=0)
    # Custom Ray resources each instance's bundle asks for, so the role lands
    # on the nodes that offer them (`ray start --resources '{"prefill": 4}'`).
    resources: dict[str, float] = Field(default_factory=dict)
    # Ray CPU grant per instance; on CPU it is also the instance's torch threads.
    num_cpus: float = Field(default=1.0, gt=0)
    # CPU ids the instances are pinned to, `num_cpus` each in order (instance
    # i takes the i-th group); None leaves placement to the OS.
    cpu_affinity: list[int] | None = None
    kv_cache: KvCacheConfig | None = None
    cache_transceiver: CacheTransceiverConfig | None = None
    max_num_tokens: int | None = Field(default=None, gt=0)
    max_batch_size: int | None = Field(default=None, gt=0)
    # Replaces the top-level block for this section when set (null: off here).
    speculative_config: SpeculativeDecodingConfig | None = None

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"resources names {name!r}, which Ray sizes itself; set num_gpus for "
                    "GPUs and list only custom resources here"
                )
            if amount <= 0:
                raise ValueError(f"resources.{name} is {amount}; give a positive amount")
        return value

    @field_validator("cpu_affinity")
    @classmethod
    def _distinct_cpu_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(set(value)) != len(value) or min(value, default=0) < 0):
            raise ValueError(f"cpu_affinity {value} must list distinct CPU ids (0, 1, ...)")
        return value

    def check_cpu_affinity(self, name: str) -> None:
        """Raise ValueError unless `cpu_affinity` gives each instance its `num_cpus` CPUs."""
        cpus = self.cpu_affinity
        if cpus is None:
            return
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"{name}.cpu_affinity pins single-rank instances; remove it or set "
                f"tensor_parallel_size to 1 (it is {self.tensor_parallel_size})"
            )
        wanted = self.num_instances * self.num_cpus
        if not self.num_cpus.is_integer() or len(cpus) != wanted:
            raise ValueError(
                f"{name}.cpu_affinity lists {len(cpus)} CPUs, but its {self.num_instances} "
                f"instance(s) of num_cpus {self.num_cpus:g} need {wanted:g}: list "
                "num_instances x num_cpus CPU ids (num_cpus a whole number)"
            )


class MediaConfig(_Strict):
    """Where chat image parts may come from, and their limits (see cluster/api/media.py)."""

    # Folder whose files `file://` image URLs may name; None refuses them.
    allowed_local_media_path: str | None = None
    # Fetch `http(s)://` image URLs (within the limits below); off refuses them.
    allow_remote_urls: bool = False
    remote_timeout_s: float = Field(default=10.0, gt=0)
    max_image_bytes: int = Field(default=10 << 20, gt=0)
    max_image_pixels: int = Field(default=25_000_000, gt=0)
    max_images_per_request: int = Field(default=8, ge=0)


class RoleSettings(_Strict):
    """The merged settings every instance of one role runs with."""

    role: Literal["context", "generation"]
    num_instances: int
    tensor_parallel_size: int
    num_gpus: float
    resources: dict[str, float]
    num_cpus: float
    cpu_affinity: list[int] | None
    kv_cache: KvCacheConfig
    cache_transceiver: CacheTransceiverConfig
    max_num_tokens: int
    max_batch_size: int
    dtype: str
    # As configured for the role; a context worker drafts only with mtp (see plan).
    speculative_config: SpeculativeDecodingConfig | None = None


class ClusterConfig(_Strict):
    model: str
    hostname: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    address: str | None = None
    startup_timeout_s: float = Field(default=300.0, gt=0)
    # Bearer token the /v1 routes require; None leaves the API open.
    api_key: str | None = Field(default=None, min_length=1)
    max_request_body_bytes: int = Field(default=1 << 20, gt=0)
    router: RouterConfig = RouterConfig()
    media: MediaConfig = MediaConfig()
    conditional_disagg: ConditionalDisaggConfig = ConditionalDisaggConfig()
    cache_transceiver: CacheTransceiverConfig = CacheTransceiverConfig()
    kv_cache: KvCacheConfig = KvCacheConfig()
    max_num_tokens: int = Field(default=2048, gt=0)
    max_batch_size: int = Field(default=32, gt=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Speculative decoding on the instances that decode (with mtp, on context
    # instances too); None (or null): off.
    speculative_config: SpeculativeDecodingConfig | None = None
    context_servers: ServerSectionConfig = ServerSectionConfig()
    generation_servers: ServerSectionConfig = ServerSectionConfig()

    @model_validator(mode="after")
    def _sections_agree_with_top_level(self) -> ClusterConfig:
        for role in ROLES:
            self.role_settings(role)
            getattr(self, role).check_cpu_affinity(role)
        if self.generation_servers.num_instances == 0:
            raise ValueError(
                "generation_servers.num_instances is 0, but every request ends on a "
                "generation instance; set it to 1 or more (context_servers.num_instances "
                "may be 0: requests then run whole on generation instances)"
            )
        return self

    @model_validator(mode="after")
    def _both_roles_agree_on_mtp(self) -> ClusterConfig:
        if self.context_servers.num_instances == 0:  # aggregated: no cache moves
            return self
        blocks = [
            (self.role_settings(role).speculative_config, speculation_origin(self, role))
            for role in ROLES
        ]
        problem = mtp_roles_disagree(*blocks[0], *blocks[1])
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> ClusterConfig:
        for name in ("context_servers", "generation_servers"):
            section: ServerSectionConfig = getattr(self, name)
            gpus, ranks = section.num_gpus, section.tensor_parallel_size
            if ranks > 1 and 0 < gpus < 1:
                raise ValueError(
                    f"{name}.num_gpus is {gpus} with tensor_parallel_size {ranks}: each rank "
                    "needs a GPU of its own (NCCL runs one rank per device); set num_gpus to 1"
                )
        return self

    def role_settings(self, section_name: str) -> RoleSettings:
        """Merge the top level with one section; raises ValueError on a conflict."""
        section: ServerSectionConfig = getattr(self, section_name)
        kv_cache = _merge_nested(self, section, section_name, "kv_cache")
        transceiver = _merge_nested(self, section, section_name, "cache_transceiver")
        scalars = {
            key: _merge_scalar(self, section, section_name, key)
            for key in ("max_num_tokens", "max_batch_size")
        }
        return RoleSettings(
            role="context" if section_name == "context_servers" else "generation",
            num_instances=section.num_instances,
            tensor_parallel_size=section.tensor_parallel_size,
            num_gpus=section.num_gpus,
            resources=section.resources,
            num_cpus=section.num_cpus,
            cpu_affinity=section.cpu_affinity,
            kv_cache=KvCacheConfig.model_validate(kv_cache),
            cache_transceiver=CacheTransceiverConfig.model_validate(transceiver),
            dtype=self.dtype,
            speculative_config=_section_speculation(self, section),
            **scalars,
        )


def _section_speculation(
    top: ClusterConfig, section: ServerSectionConfig
) -> SpeculativeDecodingConfig | None:
    """The section's `speculative_config` when it sets one (`null` included),
    else the top level's: the block is replaced whole, never merged."""
    if "speculative_config" in section.model_fields_set:
        return section.speculative_config
    return top.speculative_config


def speculation_origin(config: ClusterConfig, section_name: str) -> str | None:
    """The key a section's `speculative_config` comes from: its own block, the
    top-level one, or None where neither is set."""
    if "speculative_config" in getattr(config, section_name).model_fields_set:
        return f"{section_name}.speculative_config"
    if "speculative_config" in config.model_fields_set:
        return "speculative_config"
    return None


def _merge_scalar(top: ClusterConfig, section: ServerSectionConfig, name: str, key: str) -> Any:
    value = getattr(section, key)
    if key not in section.model_fields_set or value is None:
        return getattr(top, key)
    if key in top.model_fields_set and getattr(top, key) != value:
        raise ValueError(_conflict(key, getattr(top, key), f"{name}.{key}", value))
    return value


def _merge_nested(
    top: ClusterConfig, section: ServerSectionConfig, name: str, key: str
) -> dict[str, Any]:
    base: BaseModel = getattr(top, key)
    merged = base.model_dump()
    override: BaseModel | None = getattr(section, key)
    if override is None:
        return merged
    for field in override.model_fields_set:
        value = getattr(override, field)
        if field in base.model_fields_set and getattr(base, field) != value:
            raise ValueError(
                _conflict(f"{key}.{field}", getattr(base, field), f"{name}.{key}.{field}", value)
            )
        merged[field] = value
        if field in SIZING_KEYS:
            # A section that sizes its cache one way replaces the other way.
            for other in SIZING_KEYS:
                if other != field and other not in override.model_fields_set:
                    merged[other] = None
    return merged


def _conflict(top_key: str, top_value: Any, section_key: str, section_value: Any) -> str:
    return (
        f"{top_key} is {top_value!r} at the top level but {section_key} is "
        f"{section_value!r}; set it in one place, or give both the same value"
    )


def config_from_dict(
    raw: dict[str, Any], source: str = "<config>", key_names: Mapping[str, str] | None = None
) -> ClusterConfig:
    """Validate an already-parsed config mapping; raises `ConfigError`.

    `key_names` maps a dotted key of ours to the key the file wrote, so an
    error about a translated value names what the user wrote."""
    try:
        return ClusterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source, key_names or {})) from None


def _describe(exc: ValidationError, source: str, key_names: Mapping[str, str]) -> str:
    """One line per problem: `file:dotted.key: what to change`."""
    lines = []
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        key = ".".join(loc)
        if key in key_names and key_names[key] != key:
            key = f"{key_names[key]} (our {key})"
        where = f"{source}:{key}" if loc else source
        if error["type"] == "extra_forbidden":
            message = f"unknown key{closest_key_hint(loc[-1], native_keys_at(loc[:-1]))}"
        elif error["type"] == "value_error":
            message = str(error["ctx"]["error"])
        else:
            message = error["msg"]
        lines.append(f"{where}: {message}")
    return "\n".join(lines)


def closest_key_hint(key: str, valid: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest valid key, else the valid keys."""
    valid = sorted(set(valid))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid keys here: {', '.join(valid)}"


def native_keys_at(parent: tuple[str, ...]) -> list[str]:
    """The keys our config accepts under the dotted path `parent`."""
    model = _model_at(parent)
    assert model is not None, parent
    return list(model.model_fields)


def value_problem(path: tuple[str, ...], value: Any) -> str | None:
    """What is wrong with `value` as our key `path` taken on its own (its type
    or range, as validation would say), or None when it fits or `path` is not
    a key of ours. Checks across keys (conflicts, sizing) are not run."""
    model = _model_at(path[:-1])
    if model is None or path[-1] not in model.model_fields:
        return None
    try:
        _field_adapter(model, path[-1]).validate_python(value)
    except ValidationError as exc:
        return str(exc.errors()[0]["msg"])
    return None


def _model_at(parent: tuple[str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = ClusterConfig
    for part in parent:
        field = model.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        candidates = getattr(annotation, "__args__", (annotation,))
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


@functools.cache
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    field = model.model_fields[name]
    # The field's type with its constraints (gt, le, ...), as its model checks it.
    annotated: Any = Annotated[field.annotation, field]
    return TypeAdapter(annotated)
