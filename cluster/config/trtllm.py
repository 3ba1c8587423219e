"""TensorRT-LLM's `trtllm-serve disaggregated` YAML, read as a disagg config.

A file is in this dialect when it uses any key only TensorRT-LLM has
(`kv_cache_config`, `cache_transceiver_config`, `urls`, a section `router`,
`backend`, ...). `translate` maps it once, at load, onto our keys; the result
is validated as any disagg config (`cluster.config.schema`). Per key:

    translated   kv_cache_config.max_tokens        -> kv_cache.max_tokens
                 speculative_config (NGram, MTP)   -> speculative_config (ngram, mtp)
    ignored      urls, backend: pytorch, ...       -> listed with the reason
    refused      pipeline_parallel_size: 2, ...    -> ConfigError naming it
    ours         num_gpus, kv_cache.manager, ...   -> kept: a file may mix in
                                                      settings TensorRT-LLM lacks

Precedence is TensorRT-LLM's (`extract_disagg_cfg` in its serve code):

- every top-level key that is not one of the disaggregated server's own
  (`hostname`, `port`, `conditional_disagg_config`, ...) is a worker setting
  that each section inherits unless it sets the same key itself;
- a section that sets such a key to another value is refused, naming both:
  the key is compared whole, so a section `kv_cache_config` must equal a
  top-level one (TensorRT-LLM refuses the same file);
- within a section, `kv_cache_config.free_gpu_memory_fraction` wins over a
  plain `free_gpu_memory_fraction`, whether either was inherited or not (the
  plain key only seeds the worker's KV cache config).

One setting written in both dialects (`kv_cache.max_tokens` next to
`kv_cache_config.max_tokens`), or two different section routers (one policy
serves both pools here), is refused naming both keys.

A value of the wrong type or range for the key it maps to is refused as
that, before any comparison: `max_batch_size: eight` next to a section's
`max_batch_size: 8` is a type error, not a conflict between the two.

A memory fraction sizes a GPU instance's cache from its GPU share and a CPU
instance's from its share of the host's memory (`cluster.config.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.config.schema import (
    ROLES,
    ConfigError,
    closest_key_hint,
    native_keys_at,
    value_problem,
)
from cluster.config.trtllm_keys import (
    BACKENDS,
    CONTEXT_SPECULATION,
    CONVERSATION_NOTE,
    GUIDED_BACKEND,
    GUIDED_BACKEND_SERVED,
    KV_IGNORED,
    KV_KEYS,
    KV_REFUSED,
    MAMBA_STATE_KEYS,
    MAMBA_STATE_REFUSED,
    MTP_DEFAULT_ONLY,
    MTP_DRAFTS_DEFAULT,
    MTP_IGNORED,
    MTP_KEYS,
    NGRAM_IGNORED,
    NGRAM_KEYS,
    NGRAM_MATCH_DEFAULT,
    ONE_ONLY,
    ROUTER_IGNORED,
    ROUTER_TYPES,
    SECTION_IGNORED,
    SECTION_KEYS,
    SERVER_IGNORED,
    SHARED_KEYS,
    TOP_KEYS,
    TRANSCEIVER_IGNORED,
    WORKER_IGNORED,
    WORKER_REFUSED,
    refused_decoding_type,
)

DIALECT = "tensorrt-llm"
TRTLLM, OURS, BOTH = "tensorrt-llm", "disagg", "both"

_ONE_ROUTER = "one router policy serves both pools here"
# The top-level keys TensorRT-LLM's disaggregated server takes itself (the
# parameters of its `extract_disagg_cfg`); every other top-level key is a
# worker setting the sections inherit.
SERVER_PARAMS = frozenset(
    {
        "hostname",
        "port",
        "max_retries",
        "perf_metrics_max_requests",
        "context_servers",
        "generation_servers",
        "conditional_disagg_config",
        "otlp_config",
        "disagg_cluster",
        "node_id",
        "schedule_style",
        "allow_request_chat_template",
        "gen_strip_message_history",
        "gen_tokids_ctxbytes",
        "num_workers",
        "disagg_coordinator_url",
    }
)
# Which of a scope's two fraction keys: `kv_cache_config.free_gpu_memory_fraction`
# (NESTED) or a plain `free_gpu_memory_fraction` (PLAIN).
NESTED, PLAIN = "kv_cache_config", "plain"


@dataclass(frozen=True)
class IgnoredKey:
    key: str  # dotted, as the file wrote it
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


@dataclass(frozen=True)
class Translation:
    native: dict[str, Any]  # our config, still to validate
    key_names: dict[str, str]  # our dotted key -> the key the file wrote
    ignored: tuple[IgnoredKey, ...]


def is_trtllm(raw: dict[str, Any]) -> bool:
    """Whether the mapping uses any key (or router type) only TensorRT-LLM has,
    a `speculative_config` with its `decoding_type`, or is one of its metadata
    server configs (which `translate` names)."""
    if set(raw) & (TOP_KEYS - set(native_keys_at(()))) or "server_type" in raw:
        return True
    router = raw.get("router")
    if isinstance(router, dict) and router.get("type") in set(ROUTER_TYPES) - {"round_robin"}:
        return True
    sections = [raw[s] for s in ROLES if isinstance(raw.get(s), dict)]
    speculative = [scope.get("speculative_config") for scope in (raw, *sections)]
    if any(isinstance(block, dict) and "decoding_type" in block for block in speculative):
        return True
    section_only = SECTION_KEYS - set(native_keys_at(("context_servers",)))
    return any(set(section) & section_only for section in sections)


def translate(raw: dict[str, Any], source: str = "<config>") -> Translation:
    """Our config for a TensorRT-LLM mapping; raises `ConfigError` naming the
    file's keys (every unknown or refused key at once)."""
    return _Translator(raw, source).run()


@dataclass
class _Put:
    value: Any
    key: str  # as the file wrote it
    written: Any  # the value as the file wrote it
    dialect: str


@dataclass
class _Translator:
    raw: dict[str, Any]
    source: str
    puts: dict[tuple[str, ...], _Put] = field(default_factory=dict)
    ignored: list[IgnoredKey] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # scope (() or (section,)) -> NESTED or PLAIN -> (fraction, key), to place per section
    fractions: dict[tuple[str, ...], dict[str, tuple[Any, str]]] = field(default_factory=dict)
    reuse_scopes: list[tuple[tuple[str, ...], str]] = field(default_factory=list)
    # Keys the file wrote whose value has the wrong type or range for ours.
    mistyped: set[str] = field(default_factory=set)

    def run(self) -> Translation:
        self._is_a_disaggregated_config()
        for key, value in self.raw.items():
            self._top(key, value)
        self._sections_agree_with_inherited_keys()
        if self.errors:
            raise ConfigError("\n".join(self.errors))
        self._place_fractions()
        self._reuse_needs_v2()
        self._sections_agree_with_top_level()
        native: dict[str, Any] = {}
        for path, put in self.puts.items():
            node = native
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = put.value
        names = {".".join(path): put.key for path, put in self.puts.items()}
        return Translation(native, names, tuple(self.ignored))

    # -- one level each -------------------------------------------------

    def _top(self, key: str, value: Any) -> None:
        if key in ROLES:
            self._section(key, value)
        elif key == "conditional_disagg_config":
            for name, item in self._mapping(key, value).items():
                if name == "max_local_prefill_length":
                    self._put(("conditional_disagg", name), item, f"{key}.{name}", TRTLLM)
                else:
                    self._unknown(f"{key}.{name}", name, ["max_local_prefill_length"])
        elif key == "tensor_parallel_size":  # a default for both sections
            for role in ROLES:
                self._put((role, key), value, key, BOTH)
        elif key in SERVER_IGNORED:
            self._ignore(key, SERVER_IGNORED[key])
        elif not self._worker_key((), key, value, key):
            native = native_keys_at(())
            if key in native:
                self._ours((key,), value, key)
            else:
                self._unknown(key, key, [*TOP_KEYS, *native])

    def _section(self, role: str, section: Any) -> None:
        for key, value in self._mapping(role, section).items():
            where = f"{role}.{key}"
            if key in ("model", "dtype"):  # one per cluster here
                self._put((key,), value, where, BOTH)
            elif key == "router":
                self._router(value, where)
            elif key in SECTION_IGNORED:
                self._ignore(where, SECTION_IGNORED[key])
            elif not self._worker_key((role,), key, value, where):
                native = native_keys_at((role,))
                if key in native:
                    self._ours((role, key), value, where)
                else:
                    self._unknown(where, key, [*SECTION_KEYS, *native])

    def _worker_key(self, scope: tuple[str, ...], key: str, value: Any, where: str) -> bool:
        """A worker (LLM API) key, valid at the top level and in a section."""
        if key == "kv_cache_config":
            self._kv_cache(scope, self._mapping(where, value), where)
        elif key == "cache_transceiver_config":
            self._transceiver(scope, self._mapping(where, value), where)
        elif key == "free_gpu_memory_fraction":
            self._fraction(scope, value, where, PLAIN)
        elif key == "speculative_config":
            self._speculative(scope, value, where)
        elif key == "router" and not scope:
            self._router(value, where)
        elif key in ONE_ONLY:
            if value != 1:
                self.errors.append(
                    f"{self.source}:{where}: is {value!r}, but {ONE_ONLY[key]} parallelism is "
                    "not implemented; set it to 1 and scale out with num_instances"
                )
        elif key == "guided_decoding_backend":
            if value == GUIDED_BACKEND:
                self._ignore(where, GUIDED_BACKEND_SERVED)
            else:
                self.errors.append(
                    f"{self.source}:{where}: is {value!r}, but structured output here runs "
                    f"on {GUIDED_BACKEND}; set it to {GUIDED_BACKEND} or leave it out"
                )
        elif key in WORKER_IGNORED:
            self._ignore(where, WORKER_IGNORED[key])
        elif key in WORKER_REFUSED:
            self.errors.append(f"{self.source}:{where}: {WORKER_REFUSED[key]}")
        else:
            return False
        return True

    def _kv_cache(self, scope: tuple[str, ...], block: dict[str, Any], where: str) -> None:
        ours = {"max_tokens": "max_tokens", "tokens_per_block": "block_size"}
        for key, value in block.items():
            written = f"{where}.{key}"
            if key in ours:
                self._put((*scope, "kv_cache", ours[key]), value, written, TRTLLM)
            elif key == "enable_block_reuse":
                self._put((*scope, "kv_cache", key), value, written, TRTLLM)
                if value is True:
                    self.reuse_scopes.append((scope, written))
            elif key == "free_gpu_memory_fraction":
                self._fraction(scope, value, written, NESTED)
            elif key == "mamba_state_config":
                self._mamba_state(scope, value, written)
            elif key in KV_IGNORED:
                self._ignore(written, KV_IGNORED[key])
            elif key in KV_REFUSED:
                self.errors.append(f"{self.source}:{written}: {KV_REFUSED[key]}")
            else:
                self._unknown(written, key, [*KV_KEYS, *KV_IGNORED, *KV_REFUSED])

    def _mamba_state(self, scope: tuple[str, ...], value: Any, where: str) -> None:
        """A snapshot policy, TensorRT-LLM's keys onto `kv_cache.snapshots`;
        the end of every sequence is a snapshot point here too."""
        for key, item in self._mapping(where, value).items():
            written = f"{where}.{key}"
            if key in MAMBA_STATE_KEYS:
                self._put(
                    (*scope, "kv_cache", "snapshots", MAMBA_STATE_KEYS[key]), item, written, TRTLLM
                )
            elif key in MAMBA_STATE_REFUSED:
                if item:
                    self.errors.append(f"{self.source}:{written}: {MAMBA_STATE_REFUSED[key]}")
            else:
                self._unknown(written, key, [*MAMBA_STATE_KEYS, *MAMBA_STATE_REFUSED])

    def _speculative(self, scope: tuple[str, ...], value: Any, where: str) -> None:
        """TensorRT-LLM's NGram or MTP decoding config onto our
        `speculative_config`; a block in our keys (no `decoding_type`) is kept
        as ours. A context section's block is ignored unless it is MTP (whose
        layers run on context workers too)."""
        if value is None:  # no speculative decoding, as when absent
            return
        block = self._mapping(where, value)
        kind = block.get("decoding_type", block.get("method"))
        if scope == ("context_servers",) and str(kind).lower() != "mtp":
            self._ignore(where, CONTEXT_SPECULATION)
            return
        path = (*scope, "speculative_config")
        if "decoding_type" not in block:
            if block and not set(block) & {*NGRAM_KEYS, *NGRAM_IGNORED, *MTP_KEYS, *MTP_IGNORED}:
                self._ours(path, block, where)
            else:
                self.errors.append(
                    f"{self.source}:{where}: has no decoding_type; TensorRT-LLM needs one: "
                    "set decoding_type: NGram or MTP"
                )
            return
        if str(kind).lower() == "mtp":
            self._mtp(path, block, where)
        elif str(kind).lower() == "ngram":
            self._ngram(path, block, where)
        else:
            self.errors.append(
                f"{self.source}:{where}.decoding_type: {refused_decoding_type(kind)}"
            )

    def _ngram(self, path: tuple[str, ...], block: dict[str, Any], where: str) -> None:
        kind, written_kind = block["decoding_type"], f"{where}.decoding_type"
        if "max_draft_len" not in block:
            self.errors.append(
                f"{self.source}:{where}: NGram needs max_draft_len (the drafts a step, > 0), "
                "as in TensorRT-LLM"
            )
        # TensorRT-LLM tries n-gram sizes from the largest down to 1.
        self._put((*path, "method"), "ngram", written_kind, TRTLLM, kind)
        self._put((*path, "prompt_lookup_min"), 1, written_kind, TRTLLM, kind)
        if "max_matching_ngram_size" not in block:
            self._put((*path, "prompt_lookup_max"), NGRAM_MATCH_DEFAULT, written_kind, TRTLLM, kind)
        for key, item in block.items():
            written = f"{where}.{key}"
            if key in NGRAM_KEYS:
                self._put((*path, NGRAM_KEYS[key]), item, written, TRTLLM)
            elif key in NGRAM_IGNORED:
                self._ignore(written, NGRAM_IGNORED[key])
            elif key != "decoding_type":
                self._unknown(written, key, ["decoding_type", *NGRAM_KEYS, *NGRAM_IGNORED])

    def _mtp(self, path: tuple[str, ...], block: dict[str, Any], where: str) -> None:
        """MTP: num_nextn_predict_layers drafts a step (TensorRT-LLM's default
        1), drafted by the checkpoint's MTP layers on both roles."""
        kind, written_kind = block["decoding_type"], f"{where}.decoding_type"
        self._put((*path, "method"), "mtp", written_kind, TRTLLM, kind)
        drafts = block.get("num_nextn_predict_layers", MTP_DRAFTS_DEFAULT)
        if "num_nextn_predict_layers" not in block:
            self._put((*path, "num_speculative_tokens"), drafts, written_kind, TRTLLM, kind)
        for key, item in block.items():
            written = f"{where}.{key}"
            if key in MTP_KEYS:
                self._put((*path, MTP_KEYS[key]), item, written, TRTLLM)
            elif key == "max_draft_len":
                self._mtp_draft_len(item, drafts, written)
            elif key in MTP_DEFAULT_ONLY:
                default, why = MTP_DEFAULT_ONLY[key]
                if item == default:
                    self._ignore(written, f"{item!r} is TensorRT-LLM's default and what runs here")
                else:
                    self.errors.append(f"{self.source}:{written}: is {item!r}, but {why}")
            elif key in MTP_IGNORED:
                self._ignore(written, MTP_IGNORED[key])
            elif key != "decoding_type":
                valid = ["decoding_type", "max_draft_len", *MTP_KEYS, *MTP_DEFAULT_ONLY]
                self._unknown(written, key, [*valid, *MTP_IGNORED])

    def _mtp_draft_len(self, value: Any, drafts: Any, written: str) -> None:
        """TensorRT-LLM replaces an MTP block's max_draft_len with
        num_nextn_predict_layers; a different value is refused, not dropped."""
        if value == drafts:
            self._ignore(written, "num_nextn_predict_layers sets the drafts a step for MTP")
            return
        self.errors.append(
            f"{self.source}:{written}: is {value!r}, but for MTP num_nextn_predict_layers "
            f"({drafts!r}) is the drafts a step (TensorRT-LLM replaces max_draft_len with "
            "it); remove max_draft_len, or set num_nextn_predict_layers to the drafts you want"
        )

    def _transceiver(self, scope: tuple[str, ...], block: dict[str, Any], where: str) -> None:
        for key, value in block.items():
            written = f"{where}.{key}"
            if key == "backend":
                self._backend(scope, value, written)
            elif key == "kv_transfer_timeout_ms" and value is None:
                self._ignore(written, "a transfer always times out here (timeout_s, 30 s)")
            elif key == "kv_transfer_timeout_ms":
                seconds = value / 1000 if isinstance(value, int | float) else value
                self._put((*scope, "cache_transceiver", "timeout_s"), seconds, written, TRTLLM)
            elif key in TRANSCEIVER_IGNORED:
                self._ignore(written, TRANSCEIVER_IGNORED[key])
            else:
                self._unknown(
                    written, key, ["backend", "kv_transfer_timeout_ms", *TRANSCEIVER_IGNORED]
                )

    def _backend(self, scope: tuple[str, ...], value: Any, written: str) -> None:
        choice = BACKENDS.get(str(value).upper())
        if choice is None:
            self.errors.append(
                f"{self.source}:{written}: {value!r} is not a backend; use one of "
                f"{', '.join(BACKENDS)}"
            )
            return
        backend, wire, why = choice
        self._put((*scope, "cache_transceiver", "backend"), backend, written, TRTLLM, value)
        if wire is not None:
            self._put((*scope, "cache_transceiver", "wire"), wire, written, TRTLLM, value)
        if why is not None:
            self._ignore(written, why)

    def _router(self, block: Any, where: str) -> None:
        for key, value in self._mapping(where, block).items():
            written = f"{where}.{key}"
            if key == "type" and value in ROUTER_TYPES:
                dialect = BOTH if value == "round_robin" else TRTLLM
                self._put(("router", "type"), ROUTER_TYPES[value], written, dialect, value)
                if value == "conversation":
                    self._ignore(written, CONVERSATION_NOTE)
            elif key in native_keys_at(("router",)):
                self._put(("router", key), value, written, OURS)
            elif key in ROUTER_IGNORED:
                self._ignore(written, ROUTER_IGNORED[key])
            else:
                self._unknown(written, key, ["type", *ROUTER_IGNORED])

    def _fraction(self, scope: tuple[str, ...], value: Any, written: str, kind: str) -> None:
        if self._fits(("kv_cache", "memory_fraction"), value, written, value):
            self.fractions.setdefault(scope, {})[kind] = (value, written)

    def _ours(self, path: tuple[str, ...], value: Any, written: str) -> None:
        """One of our keys in the file: kept, leaf by leaf for a nested block."""
        dialect = BOTH if path[-1] in SHARED_KEYS else OURS
        if not isinstance(value, dict):
            self._put(path, value, written, dialect)
            return
        for key, item in value.items():
            self._put((*path, key), item, f"{written}.{key}", dialect)

    # -- after every key was read -----------------------------------------

    def _place_fractions(self) -> None:
        """Each section's fraction, by TensorRT-LLM's precedence, becomes our
        `kv_cache.memory_fraction` where max_tokens does not already size it:
        at the top level when both sections take the same top-level key."""
        chosen = {role: self._section_fraction(role) for role in ROLES}
        for value, written in dict.fromkeys(c for c in chosen.values() if c is not None):
            roles = [role for role in ROLES if chosen[role] == (value, written)]
            top_level = written.split(".")[0] not in ROLES
            scopes = [()] if top_level and roles == list(ROLES) else [(role,) for role in roles]
            for scope in scopes:
                self._place_fraction(scope, value, written)

    def _section_fraction(self, role: str) -> tuple[Any, str] | None:
        """(fraction, key) a section's workers size by: its own keys over the
        inherited ones, `kv_cache_config`'s over the plain key."""
        own, top = self.fractions.get((role,), {}), self.fractions.get((), {})
        nested = own.get(NESTED) or top.get(NESTED)
        plain = own.get(PLAIN) or top.get(PLAIN)
        if nested is not None and plain is not None:
            self._ignore(
                plain[1],
                f"on {role}, {nested[1]} sizes the cache instead (a kv_cache_config "
                "fraction wins over free_gpu_memory_fraction, as in TensorRT-LLM)",
            )
        return nested or plain

    def _place_fraction(self, scope: tuple[str, ...], value: Any, written: str) -> None:
        for path in {(*scope, "kv_cache", "memory_fraction"), ("kv_cache", "memory_fraction")}:
            ours = self.puts.get(path)
            if ours is not None and ours.dialect == OURS:
                raise ConfigError(self._mixed(ours.key, written, "kv_cache.memory_fraction"))
        sized = [(*scope, "kv_cache", "max_tokens"), ("kv_cache", "max_tokens")]
        if any(path in self.puts for path in sized):
            self._ignore(
                written,
                "kv_cache_config.max_tokens sizes this cache (TensorRT-LLM would take the "
                "smaller of the two; give one of them here)",
            )
            return
        self._put((*scope, "kv_cache", "memory_fraction"), value, written, TRTLLM)

    def _reuse_needs_v2(self) -> None:
        """Prefix reuse lives in our V2 manager; a scope that asks for reuse
        and names no manager gets V2 (hybrid models keep reuse off there)."""
        for scope, written in self.reuse_scopes:
            if (*scope, "kv_cache", "manager") not in self.puts:
                self._put((*scope, "kv_cache", "manager"), "v2", written, TRTLLM, True)

    def _is_a_disaggregated_config(self) -> None:
        """TensorRT-LLM's test folders also hold its other YAML files. A
        disaggregated config names a model or a section (TensorRT-LLM starts one
        instance of each role for a missing section); a file with neither is
        one of those others, not something to serve."""
        if "model" in self.raw or any(role in self.raw for role in ROLES):
            return
        kind = (
            "a metadata server config (trtllm-serve --metadata_server_config_file)"
            if "server_type" in self.raw
            else "a worker's --extra_llm_api_options file"
        )
        raise ConfigError(
            f"{self.source}: not a `trtllm-serve disaggregated` config: it sets no model, "
            f"context_servers or generation_servers (it looks like {kind}); point -c at the "
            "disaggregated config"
        )

    def _sections_agree_with_inherited_keys(self) -> None:
        """TensorRT-LLM's rule: a section inherits each top-level worker key it
        does not set, and refuses one it sets to another value (whole values).
        A key holding a mistyped value is already refused for that."""
        for key, value in self.raw.items():
            if key in SERVER_PARAMS:
                continue
            for role in ROLES:
                section = self.raw.get(role)
                if self._mistyped_under(key) or self._mistyped_under(f"{role}.{key}"):
                    continue
                if isinstance(section, dict) and key in section and section[key] != value:
                    self.errors.append(
                        f"{self.source}: {key} is {value!r} at the top level but {role}.{key} "
                        f"is {section[key]!r}; a section inherits the top-level {key} whole "
                        "(TensorRT-LLM refuses this file too): set it in one place, or give "
                        "both the same value"
                    )

    def _sections_agree_with_top_level(self) -> None:
        for path, put in list(self.puts.items()):
            if path[0] not in ROLES or len(path) < 2:
                continue
            top = self.puts.get(path[1:])
            if top is not None and top.value != put.value:
                raise ConfigError(self._two_values(top.key, top.written, put.key, put.written))

    # -- helpers -------------------------------------------------------

    def _put(
        self,
        path: tuple[str, ...],
        value: Any,
        written: str,
        dialect: str,
        written_value: Any = None,
    ) -> None:
        shown = value if written_value is None else written_value
        if not self._fits(path, value, written, shown):
            return
        earlier = self.puts.get(path)
        if earlier is None:
            self.puts[path] = _Put(value, written, shown, dialect)
            return
        if {earlier.dialect, dialect} == {TRTLLM, OURS}:
            raise ConfigError(self._mixed(earlier.key, written, ".".join(path)))
        if earlier.value != value:
            raise ConfigError(self._two_values(earlier.key, earlier.written, written, shown))

    def _fits(self, path: tuple[str, ...], value: Any, written: str, shown: Any) -> bool:
        """Whether `value` has the type and range of our key `path`. A value
        that does not is reported as such, once per key the file wrote, and
        kept out of every comparison: a conflict with it would hide what is
        wrong with it."""
        problem = value_problem(path, value)
        if problem is None:
            return True
        if written not in self.mistyped:
            self.mistyped.add(written)
            ours = "" if written.split(".")[-1] == path[-1] else f" (our {'.'.join(path)})"
            self.errors.append(f"{self.source}:{written}{ours}: {problem} (got {shown!r})")
        return False

    def _mistyped_under(self, key: str) -> bool:
        """Whether the file key `key` (dotted) holds, or is, a mistyped value."""
        return any(w == key or w.startswith(f"{key}.") for w in self.mistyped)

    def _mixed(self, first: str, second: str, ours: str) -> str:
        return (
            f"{self.source}: {first} and {second} both set {ours}, one in "
            "TensorRT-LLM's keys and one in ours; keep one of them"
        )

    def _two_values(self, first: str, first_value: Any, second: str, second_value: Any) -> str:
        hint = f" ({_ONE_ROUTER})" if "router" in first else ""
        return (
            f"{self.source}: {first} is {first_value!r} but {second} is {second_value!r}"
            f"{hint}; set it in one place, or give both the same value"
        )

    def _mapping(self, where: str, value: Any) -> dict[str, Any]:
        if value is None:  # `key:` with nothing under it
            return {}
        if isinstance(value, dict):
            return value
        self.errors.append(f"{self.source}:{where}: must be a mapping of keys, got {value!r}")
        return {}

    def _ignore(self, key: str, reason: str) -> None:
        if IgnoredKey(key, reason) not in self.ignored:
            self.ignored.append(IgnoredKey(key, reason))

    def _unknown(self, written: str, key: str, valid: list[str]) -> None:
        self.errors.append(f"{self.source}:{written}: unknown key{closest_key_hint(key, valid)}")
