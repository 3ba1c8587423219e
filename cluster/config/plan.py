"""Resolve a `ClusterConfig` once into a frozen per-instance plan.

Every `auto` value is decided here, before any actor exists, with the rules
of `kvcache.resolution` and the model class's preferences from
`models.registry`. A NIXL cluster whose sides are forced to different
managers fails here with one message, so nothing is started for it.

`format_plan` renders the plan as the table `disagg serve` prints:

    instance    role        manager  transceiver  block  blocks  slots  device  cpus
    context-0   context     v1       python       16     512     0      cpu     1

With `context_servers.num_instances: 0` the plan is aggregated only: every
generation instance runs whole requests (role "aggregated", no transceiver).
With `speculative_config` set, the title says how the generation (or
aggregated) instances draft: with ngram context instances never do; with mtp
they run the checkpoint's MTP layers too (and send the first drafts), so
their caches hold the MTP attention layer as well. MTP needs a checkpoint
with MTP layers; one without fails here.

An instance of N tensor-parallel ranks shows its device as `cpu xN` and asks
for its cpus once per rank; its blocks and slots are each rank's (every rank
holds the same block ids, over its own KV heads).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cluster.config.schema import (
    ClusterConfig,
    ConfigError,
    KvCacheConfig,
    RoleSettings,
    SnapshotsConfig,
    speculation_origin,
)
from cluster.config.speculation import (
    describe_speculation,
    mtp_checkpoint_problem,
    mtp_model_config,
    worker_speculation,
)
from engine.checkpoint_copy import CheckpointSource
from engine.speculation.config import SpeculativeConfig, SpeculativeConfigError
from engine.worker_config import WorkerConfig
from kvcache.errors import CacheSizingError, ResolutionError
from kvcache.hashing import cache_namespace
from kvcache.resolution import (
    resolve_block_reuse,
    resolve_cluster_managers,
    resolve_manager,
    resolve_transceiver,
)
from kvcache.sizing import CacheSizing, host_available_bytes, size_instance_cache
from kvcache.snapshots import SnapshotPolicy
from kvcache.spec import CacheSpec
from models.checkpoint_source import GGUF_SUFFIX, checkpoint_folder, model_source
from models.config import ModelConfig
from models.errors import CheckpointError, TokenizerError
from models.errors import ConfigError as ModelConfigError
from models.hf_config import load_model_config
from models.registry import check_tensor_parallel, model_preferences
from models.sharding import shard_config
from transfer.nixl.agent import nixl_available

DEFAULT_MAX_TOKENS = 8192
# `org/name` as the Hugging Face Hub spells a model id.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# The transceiver of an aggregated-only plan.
NO_TRANSCEIVER = "none"


@dataclass(frozen=True)
class InstancePlan:
    """One worker actor, fully resolved.

    num_blocks is None when the cache is sized from device memory that only
    the worker can see (`memory_fraction` on a GPU): the worker measures its
    share of the GPU once its weights are loaded.
    """

    name: str
    role: str  # "context" or "generation"
    manager: str
    transceiver: str
    block_size: int
    enable_block_reuse: bool
    max_tokens: int | None
    kv_cache_memory_bytes: int | None
    memory_fraction: float | None
    num_blocks: int | None
    num_tokens: int | None
    num_mamba_slots: int
    max_num_tokens: int
    max_batch_size: int
    dtype: str | None
    num_gpus: float
    lease_s: float
    transfer_timeout_s: float
    num_cpus: float = 1.0
    # A generation instance of a cluster with no context instances: it runs
    # every request whole and builds no transceiver.
    aggregated: bool = False
    # A worker never needs to queue more than the whole cluster admits.
    max_num_waiting: int = 1024
    # "tcp", "ucx" or "auto"; auto is resolved on the worker (see WorkerConfig).
    transfer_wire: str = "tcp"
    # Custom Ray resources the instance's bundle asks for (placement by role).
    resources: dict[str, float] = field(default_factory=dict)
    # Ranks of the instance; the cache sizes above are each rank's.
    tensor_parallel_size: int = 1
    # CPU ids its worker process is pinned to; empty: wherever the OS runs it.
    cpu_affinity: tuple[int, ...] = ()
    # Mamba snapshot policy where block reuse is on for a hybrid model.
    snapshots: SnapshotPolicy | None = None
    num_snapshot_bytes: int = 0  # what its snapshot slots take, per rank
    num_verify_slots: int = 0  # Mamba scratch slots of speculative verifies (hybrids)
    # How its worker drafts; None: no speculative decoding (a context
    # instance unless the model drafts, as with mtp).
    speculative: SpeculativeConfig | None = None

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus > 0 else "cpu"

    @property
    def worker_role(self) -> str:
        """The role its worker actor runs as: context, generation or aggregated."""
        return "aggregated" if self.aggregated else self.role

    def worker_config(
        self,
        checkpoint: str,
        cluster_secret: str,
        transfer_host: str,
        checkpoint_source: CheckpointSource | None = None,
    ) -> WorkerConfig:
        return WorkerConfig(
            checkpoint=checkpoint,
            checkpoint_source=checkpoint_source,
            dtype=self.dtype,
            device=self.device,
            manager=self.manager,
            # An aggregated worker builds no transceiver; the field keeps a valid value.
            transceiver="python" if self.aggregated else self.transceiver,
            block_size=self.block_size,
            max_tokens=self.max_tokens,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            memory_fraction=self.memory_fraction if self.num_blocks is None else None,
            gpu_share=self.num_gpus or 1.0,
            max_num_tokens=self.max_num_tokens,
            max_batch_size=self.max_batch_size,
            max_num_waiting=self.max_num_waiting,
            enable_block_reuse=self.enable_block_reuse,
            lease_s=self.lease_s,
            transfer_timeout_s=self.transfer_timeout_s,
            cluster_secret=cluster_secret,
            transfer_host=transfer_host,
            transfer_wire=self.transfer_wire,
            tensor_parallel_size=self.tensor_parallel_size,
            cpu_affinity=self.cpu_affinity,
            snapshots=self.snapshots,
            speculative=self.speculative,
        )


@dataclass(frozen=True)
class ClusterPlan:
    checkpoint: str
    # What `model:` names on the serving node, absolute: the checkpoint folder
    # or its GGUF file; a node without it is sent a copy.
    model_source: str
    architecture: str
    is_hybrid: bool
    transceiver: str
    max_model_len: int
    vocab_size: int
    # Namespace of KV block hashes; must match the workers' managers.
    hash_namespace: str
    instances: tuple[InstancePlan, ...]

    def of_role(self, role: str) -> list[InstancePlan]:
        return [i for i in self.instances if i.role == role]

    @property
    def aggregated_only(self) -> bool:
        return not self.of_role("context")

    @property
    def uses_mtp(self) -> bool:
        """Whether the workers load the checkpoint's MTP layers (MTP drafting)."""
        return any(i.speculative is not None and i.speculative.uses_model for i in self.instances)

    @property
    def num_cpus(self) -> float:
        """CPUs all instances together ask Ray for (once per tensor-parallel rank)."""
        return sum(i.num_cpus * i.tensor_parallel_size for i in self.instances)


def resolve_plan(
    config: ClusterConfig, source: str = "<config>", model_key: str | None = None
) -> ClusterPlan:
    """Resolve every `auto` of `config`; raises `ConfigError` naming what to change.

    `source` names the config in messages; `model_key`, where its `model`
    was set when that is elsewhere (`--model`; default `<source>:model`)."""
    model_key = model_key or f"{source}:model"
    try:
        # A GGUF file becomes its cached checkpoint folder here, once.
        checkpoint = checkpoint_folder(config.model)
        model_config = load_model_config(checkpoint)
    except (OSError, ValueError) as exc:
        if not Path(config.model).exists():
            raise ConfigError(_not_a_local_model(config.model, model_key)) from exc
        raise ConfigError(f"{model_key}: {_unloadable(config.model, exc)}") from exc
    preferred_manager, preferred_transceiver = model_preferences(model_config.architecture)
    context = config.role_settings("context_servers")
    generation = config.role_settings("generation_servers")
    try:
        if context.num_instances == 0:  # aggregated only: no cache ever moves
            transceiver = NO_TRANSCEIVER
            managers = ("", resolve_manager(generation.kv_cache.manager, preferred_manager))
        else:
            transceiver = _one_transceiver(context, generation, preferred_transceiver)
            managers = resolve_cluster_managers(
                context.kv_cache.manager,
                generation.kv_cache.manager,
                preferred_manager,
                transceiver,
            )
    except ResolutionError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    spec = model_config.cache_spec(_dtype(config.dtype))
    model_len = model_config.max_position_embeddings
    max_waiting = config.router.max_queued_requests
    host_share = _host_share(context, generation)
    instances: tuple[InstancePlan, ...] = ()
    for settings, manager in ((context, managers[0]), (generation, managers[1])):
        if settings.num_instances == 0:
            continue
        speculative = _speculative(config, settings, model_config, checkpoint, source)
        # With MTP the worker's cache holds the MTP attention layer too.
        role_model = mtp_model_config(model_config, speculative)
        rank_spec = _rank_spec(role_model, settings, _dtype(config.dtype), source)
        instances += tuple(
            _instance(
                settings,
                index,
                manager,
                transceiver,
                rank_spec,
                speculative,
                model_len,
                source,
                max_waiting,
                host_share,
            )
            for index in range(settings.num_instances)
        )
    return ClusterPlan(
        checkpoint=str(checkpoint),
        model_source=str(model_source(config.model).resolve()),
        architecture=model_config.architecture,
        is_hybrid=spec.is_hybrid,
        transceiver=transceiver,
        max_model_len=_max_model_len(model_config, instances),
        vocab_size=model_config.vocab_size,
        hash_namespace=cache_namespace(model_config.architecture, spec.dtype),
        instances=instances,
    )


def _not_a_local_model(model: str, model_key: str) -> str:
    """Nothing is downloaded at run time: a hub id must become a folder first.
    A path like the example configs' `checkpoints/tiny-llama` is a folder
    `disagg make-checkpoint` writes, not a hub id."""
    message = f"{model_key}: {model!r} is not a local folder or file"
    written = _made_by_make_checkpoint(model)
    if written is not None:
        return (
            f"{message}: there is no such folder under {Path.cwd()}; write it with "
            f"`disagg make-checkpoint {written} {model}` (or point model, or --model, at "
            "your own checkpoint folder)"
        )
    if Path(model).is_absolute():
        return f"{message}: no such path"
    if model.startswith(("./", "../")) or Path(Path(model).parts[0]).is_dir():
        return f"{message}: no such path under {Path.cwd()}"
    if HUB_ID.fullmatch(model):
        message += (
            "; it looks like a Hugging Face Hub id, and nothing is downloaded here: "
            f"download it first (e.g. `huggingface-cli download {model} --local-dir DIR`) "
            "and set model (or --model) to that folder"
        )
    return message


def _unloadable(model: str, exc: Exception) -> str:
    """Why an existing `model` does not load. The loaders' own errors name the
    file and what is wrong; any other error from a GGUF file is its reader
    running past the end of a file that is cut short."""
    if isinstance(exc, CheckpointError | ModelConfigError | TokenizerError):
        return str(exc)
    if Path(model).suffix == GGUF_SUFFIX:
        return (
            f"{model} is not a readable GGUF file ({exc}); it is truncated or damaged: "
            "copy or download it again"
        )
    return f"cannot load {model}: {exc}"


def _made_by_make_checkpoint(model: str) -> str | None:
    """The `disagg make-checkpoint` flags that write a folder named like
    `model`'s last part (`tiny-llama`, `mini-nemotron-h`, ...); None when
    it is not named that way."""
    size, _, family = Path(model).name.partition("-")
    arch = {"llama": "llama", "nemotron-h": "nemotron_h", "nemotron-vl": "nemotron_vl"}.get(family)
    if arch is None or size not in ("tiny", "small", "mini"):
        return None
    return f"--arch {arch}" + ("" if size == "tiny" else f" --size {size}")


def _rank_spec(
    model_config: ModelConfig, settings: RoleSettings, dtype: str | None, source: str
) -> CacheSpec:
    """The cache of one rank of the role's instances (its KV heads only)."""
    size = settings.tensor_parallel_size
    if size == 1:
        return model_config.cache_spec(dtype)
    try:
        check_tensor_parallel(model_config, size)
        rank_config = shard_config(model_config, 0, size)
    except ModelConfigError as exc:
        raise ConfigError(f"{source}: {settings.role}_servers: {exc}") from exc
    return rank_config.cache_spec(dtype)


def _one_transceiver(context: RoleSettings, generation: RoleSettings, preferred: str | None) -> str:
    if max(context.tensor_parallel_size, generation.tensor_parallel_size) > 1:
        # Head slices between ranks are small runs: the Python transceiver
        # sends them from the pool as they lie, NIXL as a descriptor each.
        preferred = "python"
    chosen = {
        role.role: resolve_transceiver(role.cache_transceiver.backend, preferred, nixl_available())
        for role in (context, generation)
    }
    if chosen["context"] != chosen["generation"]:
        raise ResolutionError(
            f"cache_transceiver.backend resolves to {chosen['context']!r} on context_servers "
            f"but {chosen['generation']!r} on generation_servers; both sides of a transfer "
            "use one transceiver: set cache_transceiver.backend once at the top level"
        )
    return chosen["context"]


def _instance(
    settings: RoleSettings,
    index: int,
    manager: str,
    transceiver: str,
    spec: CacheSpec,
    speculative: SpeculativeConfig | None,
    model_len: int,
    source: str,
    max_num_waiting: int,
    host_share: int | None,
) -> InstancePlan:
    kv = settings.kv_cache
    max_tokens, memory_bytes = _cache_budget(kv, settings, host_share)
    snapshots = snapshot_policy(kv.snapshots, settings.max_batch_size) if spec.is_hybrid else None
    reuse = resolve_block_reuse(kv.enable_block_reuse, manager, spec.is_hybrid, snapshots)
    if not reuse:
        snapshots = None
    depth = 0 if speculative is None else speculative.num_speculative_tokens
    sizing = None
    if max_tokens is not None or memory_bytes is not None:
        sizing = _size(
            spec, settings, max_tokens, memory_bytes, model_len, source, snapshots, depth
        )
    return InstancePlan(
        name=f"{settings.role}-{index}",
        role=settings.role,
        manager=manager,
        transceiver=transceiver,
        block_size=kv.block_size,
        enable_block_reuse=reuse,
        max_tokens=max_tokens,
        kv_cache_memory_bytes=memory_bytes,
        memory_fraction=kv.memory_fraction,
        num_blocks=None if sizing is None else sizing.num_blocks,
        num_tokens=None if sizing is None else sizing.num_tokens,
        num_mamba_slots=0 if sizing is None else sizing.num_mamba_slots,
        max_num_tokens=settings.max_num_tokens,
        max_batch_size=settings.max_batch_size,
        dtype=_dtype(settings.dtype),
        num_gpus=settings.num_gpus,
        lease_s=settings.cache_transceiver.lease_s,
        transfer_timeout_s=settings.cache_transceiver.timeout_s,
        max_num_waiting=max_num_waiting,
        transfer_wire=settings.cache_transceiver.wire,
        resources=dict(settings.resources),
        tensor_parallel_size=settings.tensor_parallel_size,
        num_cpus=settings.num_cpus,
        cpu_affinity=_instance_cpus(settings, index),
        aggregated=transceiver == NO_TRANSCEIVER,
        snapshots=snapshots,
        num_snapshot_bytes=0 if sizing is None else sizing.snapshot_bytes,
        num_verify_slots=0 if sizing is None else sizing.num_verify_slots,
        speculative=speculative,
    )


def _speculative(
    config: ClusterConfig,
    settings: RoleSettings,
    model_config: ModelConfig,
    checkpoint: Path,
    source: str,
) -> SpeculativeConfig | None:
    """How the role's workers draft; MTP also needs the checkpoint's MTP
    layers and one rank per instance. Raises `ConfigError` naming the key."""
    section = f"{settings.role}_servers"
    try:
        speculative = worker_speculation(settings.speculative_config, settings.role)
    except SpeculativeConfigError as exc:
        raise ConfigError(f"{source}: {section}.speculative_config: {exc}") from exc
    if speculative is None or not speculative.uses_model:
        return speculative
    key = f"{speculation_origin(config, section)}.method"
    problem = mtp_checkpoint_problem(model_config, checkpoint, key)
    if problem is not None:
        raise ConfigError(f"{source}:{problem}")
    return speculative


def snapshot_policy(config: SnapshotsConfig, max_batch_size: int) -> SnapshotPolicy:
    """The worker's snapshot policy from `kv_cache.snapshots`."""
    return SnapshotPolicy(
        interval=config.interval,
        at_end=config.at_end,
        on_demand=config.on_demand,
        positions=tuple(config.positions),
        num_slots=max_batch_size if config.num_slots is None else config.num_slots,
    )


def _instance_cpus(settings: RoleSettings, index: int) -> tuple[int, ...]:
    """Instance `index`'s group of its section's `cpu_affinity` (checked to
    hold `num_cpus` per instance); empty when the section pins nothing."""
    if settings.cpu_affinity is None:
        return ()
    per = int(settings.num_cpus)
    return tuple(settings.cpu_affinity[index * per : (index + 1) * per])


def _host_share(*roles: RoleSettings) -> int | None:
    """Each CPU rank's share of this host's available memory, when a CPU role
    sizes its cache by `memory_fraction` without `cpu_memory_bytes`: read once,
    so every instance's fraction applies to the same figure.

    The share divides the memory among all CPU ranks of the plan, as
    `num_gpus` divides a GPU, so fractions that each stay within 1 never ask
    for more than the host has together. It is measured where the plan is
    made (the node `disagg serve` runs on); give `kv_cache.cpu_memory_bytes`
    where the workers' nodes differ from it.
    """
    on_cpu = [role for role in roles if role.num_gpus == 0 and role.num_instances > 0]
    if not any(
        role.kv_cache.memory_fraction is not None and role.kv_cache.cpu_memory_bytes is None
        for role in on_cpu
    ):
        return None
    ranks = sum(role.num_instances * role.tensor_parallel_size for role in on_cpu)
    return host_available_bytes() // ranks


def _cache_budget(
    kv: KvCacheConfig, settings: RoleSettings, host_share: int | None
) -> tuple[int | None, int | None]:
    """(max_tokens, kv_cache_memory_bytes); exactly one is known, or the
    bytes come later from the GPU probe."""
    if kv.max_tokens is not None:
        return kv.max_tokens, None
    on_gpu = settings.num_gpus > 0
    if kv.memory_fraction is not None and on_gpu:
        return None, None
    if kv.cpu_memory_bytes is not None and not on_gpu:
        return None, int(kv.cpu_memory_bytes * (kv.memory_fraction or 1.0))
    if kv.memory_fraction is not None and host_share is not None:
        return None, int(host_share * kv.memory_fraction)
    return DEFAULT_MAX_TOKENS, None


def _size(
    spec: CacheSpec,
    settings: RoleSettings,
    max_tokens: int | None,
    memory_bytes: int | None,
    model_len: int,
    source: str,
    snapshots: SnapshotPolicy | None,
    verify_depth: int = 0,
) -> CacheSizing:
    """The blocks and slots the worker will build, with the worker's own rule
    (`verify_depth`: drafts a verify takes, for a hybrid's verify slots)."""
    try:
        return size_instance_cache(
            spec,
            block_size=settings.kv_cache.block_size,
            model_len=model_len,
            max_batch_size=settings.max_batch_size,
            max_tokens=max_tokens,
            memory_bytes=memory_bytes,
            num_snapshot_slots=0 if snapshots is None else snapshots.num_slots,
            verify_depth=verify_depth,
        )
    except CacheSizingError as exc:
        raise ConfigError(f"{source}: {settings.role}_servers.kv_cache: {exc}") from exc


def _max_model_len(model_config: ModelConfig, instances: tuple[InstancePlan, ...]) -> int:
    """Longest prompt + output one request may have: the model's limit, or the
    smallest cache of any instance it may run on, whichever is lower."""
    sizes = [i.num_tokens for i in instances if i.num_tokens is not None]
    return min([model_config.max_position_embeddings, *sizes])


def _dtype(value: str) -> str | None:
    return None if value == "auto" else value


def _slots_cell(instance: InstancePlan) -> str:
    """Running Mamba slots, the snapshot slots of hybrid reuse with their
    size, and the verify slots of speculative decoding."""
    verify = f" + {instance.num_verify_slots} verify" if instance.num_verify_slots else ""
    if instance.snapshots is None:
        return f"{instance.num_mamba_slots}{verify}"
    size = (
        f", {instance.num_snapshot_bytes / (1 << 20):.1f} MiB"
        if instance.num_snapshot_bytes
        else ""
    )
    return f"{instance.num_mamba_slots} + {instance.snapshots.num_slots} snapshots{verify}{size}"


def format_plan(plan: ClusterPlan) -> str:
    header = (
        "instance",
        "role",
        "manager",
        "transceiver",
        "block",
        "blocks",
        "slots",
        "device",
        "cpus",
    )
    rows = [header] + [
        (
            i.name,
            i.worker_role,
            i.manager,
            i.transceiver,
            str(i.block_size),
            "by memory" if i.num_blocks is None else str(i.num_blocks),
            _slots_cell(i),
            i.device if i.tensor_parallel_size == 1 else f"{i.device} x{i.tensor_parallel_size}",
            f"{i.num_cpus:g}"
            + (f" on {','.join(map(str, i.cpu_affinity))}" if i.cpu_affinity else ""),
        )
        for i in plan.instances
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    title = f"model {plan.checkpoint} ({plan.architecture}), transceiver {plan.transceiver}"
    if plan.aggregated_only:
        title = (
            f"model {plan.checkpoint} ({plan.architecture}), aggregated only: no context "
            "instances, every request runs whole on a generation instance"
        )
    return "\n".join([title + _speculation_note(plan), *(line.rstrip() for line in lines)])


def _speculation_note(plan: ClusterPlan) -> str:
    """`; speculative decoding on generation instances: ngram, ...`, or "" when off.
    With ngram only the generation (or aggregated) role drafts; with mtp the
    context role runs the MTP layers too. The verifying role's setting is named."""
    drafting = [(i.worker_role, s) for i in plan.instances if (s := i.speculative) is not None]
    if not drafting:
        return ""
    roles = " and ".join(dict.fromkeys(role for role, _ in drafting))
    speculative = drafting[-1][1]
    note = f"; speculative decoding on {roles} instances: {describe_speculation(speculative)}"
    if speculative.uses_model and "context" in roles:
        note += " (context instances send the first drafts with the first token)"
    return note
