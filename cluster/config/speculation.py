"""`speculative_config`: speculative decoding as the YAML writes it (vLLM's
keys), the `SpeculativeConfig` each worker is built with, and the checks a
method needs of the roles and the checkpoint.

    speculative_config: {method: ngram, num_speculative_tokens: 3,
                         prompt_lookup_min: 2, prompt_lookup_max: 4}
    speculative_config: {method: mtp, num_speculative_tokens: 3}

n-gram drafts run where decoding runs: on generation (and aggregated)
instances. A context instance samples only a request's first token, so with
ngram it gets None whatever the config says.

MTP drafts come from the checkpoint's own multi-token-prediction layers,
which run on every role: a context worker returns the first drafts with the
first token, and the MTP attention layer's KV is one more attention layer of
the paged cache, so both sides of a transfer need it. Hence, at load, both
sections use mtp or neither does (`mtp_roles_disagree`); at plan time the
checkpoint must have MTP layers (`mtp_checkpoint_problem`). Any number of
ranks drafts: every rank runs its shard of the MTP layers on rank 0's kept
tokens (`engine.model_runner.ModelRunner.follow_mtp`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.speculation.config import (
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    MODEL_METHODS,
    SpeculativeConfig,
)
from models.config import ModelConfig

# The engine's defaults, so a key left out means what the worker would pick.
_ENGINE_DEFAULTS = SpeculativeConfig()
# Keys only n-gram drafting reads.
NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
AVAILABLE = (
    "available: method: mtp (the checkpoint's own MTP layers) or method: ngram "
    "(prompt lookup, no draft model)"
)
# vLLM's other method names -> what they are, for the refusal.
OTHER_METHODS = {
    "eagle": "EAGLE draft heads",
    "eagle3": "EAGLE-3 draft heads",
    "medusa": "Medusa heads",
    "mlp_speculator": "an MLP speculator",
    "draft_model": "a separate draft model",
    "suffix": "suffix decoding",
}
CONTEXT_DOES_NOT_DRAFT = (
    "off on context workers: they sample only a request's first token, n-gram "
    "drafting runs on the generation workers"
)
CONTEXT_DRAFTS_MTP = (
    "context workers run the MTP layers too and send the first drafts with the first token"
)


class SpeculativeDecodingConfig(BaseModel):
    """Speculative decoding, in vLLM's keys.

    method: "ngram" (prompt lookup: the tokens after the latest earlier match
    of the sequence's own last n tokens are the drafts) or "mtp" (the
    checkpoint's multi-token-prediction layers draft, run after every
    forward). num_speculative_tokens: drafts verified per request and step.
    prompt_lookup_min / prompt_lookup_max: the n-gram sizes tried, longest
    first (ngram only).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = _ENGINE_DEFAULTS.method
    num_speculative_tokens: int = Field(
        default=_ENGINE_DEFAULTS.num_speculative_tokens, ge=1, le=MAX_SPECULATIVE_TOKENS
    )
    prompt_lookup_min: int = Field(default=_ENGINE_DEFAULTS.prompt_lookup_min, ge=1)
    prompt_lookup_max: int = Field(default=_ENGINE_DEFAULTS.prompt_lookup_max, ge=1)

    @property
    def uses_model(self) -> bool:
        """The model's own layers draft: they run on context workers too."""
        return self.method in MODEL_METHODS

    @field_validator("method")
    @classmethod
    def _available_method(cls, value: str) -> str:
        if value in METHODS:
            return value
        if "mtp" in value.lower():  # vLLM's deepseek_mtp, nemotron_h_mtp, ...
            raise ValueError(
                f"method {value!r} is not a method here: the checkpoint's own MTP layers "
                f"are method: mtp, whatever the model; {AVAILABLE}"
            )
        what = OTHER_METHODS.get(value.lower())
        if what is not None:
            raise ValueError(f"method {value!r} ({what}) is not available here; {AVAILABLE}")
        raise ValueError(f"method {value!r} is not a speculative method; {AVAILABLE}")

    @model_validator(mode="after")
    def _keys_of_the_method(self) -> SpeculativeDecodingConfig:
        if self.uses_model:
            given = [key for key in NGRAM_ONLY if key in self.model_fields_set]
            if given:
                verb, it = ("belong", "them") if len(given) > 1 else ("belongs", "it")
                raise ValueError(
                    f"{' and '.join(given)} {verb} to method ngram (the n-gram sizes of "
                    f"prompt lookup); method {self.method} drafts with the checkpoint's MTP "
                    f"layers: remove {it}"
                )
            return self
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low > high:
            raise ValueError(
                f"prompt_lookup_min ({low}) is above prompt_lookup_max ({high}); the "
                "n-gram sizes tried run from prompt_lookup_max down to prompt_lookup_min"
            )
        return self

    def drafted_fields(self) -> tuple[str, ...]:
        """The fields this block's method reads."""
        names = tuple(type(self).model_fields)
        return tuple(n for n in names if n not in NGRAM_ONLY) if self.uses_model else names


def worker_speculation(
    config: SpeculativeDecodingConfig | None, role: str
) -> SpeculativeConfig | None:
    """The `SpeculativeConfig` a worker of `role` ("context" or "generation")
    runs with; None when off. A context worker gets one only when the model
    drafts (`SpeculativeConfig.uses_model`: it runs the MTP layers and sends
    the first drafts); with ngram it gets None. Raises
    `SpeculativeConfigError` where the engine refuses what the schema let by."""
    if config is None or (role == "context" and not config.uses_model):
        return None
    return SpeculativeConfig(
        method=config.method,
        num_speculative_tokens=config.num_speculative_tokens,
        prompt_lookup_min=config.prompt_lookup_min,
        prompt_lookup_max=config.prompt_lookup_max,
    )


def describe_speculation(config: SpeculativeConfig) -> str:
    """One phrase for the plan: `ngram, 3 drafts a step from n-grams of 4 down to 2`,
    or `mtp, 3 drafts a step from the checkpoint's MTP layers`."""
    k = config.num_speculative_tokens
    drafts = f"{config.method}, {k} draft{'s' if k > 1 else ''} a step"
    if config.uses_model:
        return f"{drafts} from the checkpoint's MTP layers"
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    sizes = f"n-grams of {high}" if low == high else f"n-grams of {high} down to {low}"
    return f"{drafts} from {sizes}"


def mtp_roles_disagree(
    context: SpeculativeDecodingConfig | None,
    context_origin: str | None,
    generation: SpeculativeDecodingConfig | None,
    generation_origin: str | None,
) -> str | None:
    """Why the two sections' blocks cannot run together, or None.

    The MTP attention layer's KV is part of the cache layout, so one section
    with mtp needs the other with mtp too. `*_origin` is the key each block
    came from ("speculative_config", "context_servers.speculative_config")
    or None where neither sets one."""
    uses = [block is not None and block.uses_model for block in (context, generation)]
    if uses[0] == uses[1]:
        return None
    return (
        f"{_role_phrase('context_servers', context, context_origin)} but "
        f"{_role_phrase('generation_servers', generation, generation_origin)}; the MTP "
        "attention layer's KV is part of the cache that moves from context to generation "
        "workers: give both sections method mtp, or neither"
    )


def _role_phrase(section: str, block: SpeculativeDecodingConfig | None, origin: str | None) -> str:
    if block is not None:
        where = "the top-level speculative_config" if origin == "speculative_config" else origin
        return f"{section} drafts with method {block.method} ({where})"
    if origin is None:
        return f"{section} has no speculative_config"
    return f"{section} has speculative decoding off ({origin}: null)"


def mtp_checkpoint_problem(model_config: ModelConfig, checkpoint: Path, key: str) -> str | None:
    """What is missing for MTP drafting on this checkpoint (`key`: the
    config key that asks for it, `...speculative_config.method`), or None."""
    if model_config.mtp_layer_types:
        return None
    return (
        f"{key}: mtp needs a checkpoint with MTP layers; {Path(checkpoint) / 'config.json'} "
        f"has num_nextn_predict_layers {model_config.num_nextn_predict_layers} (use method: "
        "ngram, or a checkpoint that ships its mtp.* layers)"
    )


def mtp_model_config(
    model_config: ModelConfig, speculative: SpeculativeConfig | None
) -> ModelConfig:
    """The model config a worker drafting with `speculative` builds: with
    MTP, its MTP layers and their attention KV in the cache (`use_mtp`)."""
    if speculative is None or not speculative.uses_model:
        return model_config
    return replace(model_config, use_mtp=True)
