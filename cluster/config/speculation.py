"""`speculative_config`: speculative decoding as the YAML writes it (vLLM's
keys), and the `SpeculativeConfig` each worker is built with.

    speculative_config: {method: ngram, num_speculative_tokens: 3,
                         prompt_lookup_min: 2, prompt_lookup_max: 4}

Drafting runs where decoding runs: on generation (and aggregated) instances.
A context instance samples only a request's first token, so it gets None
whatever the config says.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.speculation.config import (
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    SpeculativeConfig,
)

# The engine's defaults, so a key left out means what the worker would pick.
_ENGINE_DEFAULTS = SpeculativeConfig()
MTP_UNAVAILABLE = (
    "Nemotron-H MTP drafting is not available in this build; use method: ngram "
    "(prompt lookup, no draft model), or remove speculative_config"
)
CONTEXT_DOES_NOT_DRAFT = (
    "off on context workers: they sample only a request's first token, "
    "drafting runs on the generation workers"
)


class SpeculativeDecodingConfig(BaseModel):
    """Speculative decoding, in vLLM's keys.

    method: "ngram" (prompt lookup: the tokens after the latest earlier match
    of the sequence's own last n tokens are the drafts). num_speculative_tokens:
    drafts verified per request and step. prompt_lookup_min / prompt_lookup_max:
    the n-gram sizes tried, longest first.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = _ENGINE_DEFAULTS.method
    num_speculative_tokens: int = Field(
        default=_ENGINE_DEFAULTS.num_speculative_tokens, ge=1, le=MAX_SPECULATIVE_TOKENS
    )
    prompt_lookup_min: int = Field(default=_ENGINE_DEFAULTS.prompt_lookup_min, ge=1)
    prompt_lookup_max: int = Field(default=_ENGINE_DEFAULTS.prompt_lookup_max, ge=1)

    @field_validator("method")
    @classmethod
    def _available_method(cls, value: str) -> str:
        if "mtp" in value.lower():  # vLLM's mtp, deepseek_mtp, ...
            raise ValueError(f"method {value!r}: {MTP_UNAVAILABLE}")
        if value not in METHODS:
            raise ValueError(
                f"method {value!r} is not available here; use method: ngram "
                "(prompt lookup, no draft model)"
            )
        return value

    @model_validator(mode="after")
    def _lookup_sizes_in_order(self) -> SpeculativeDecodingConfig:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low > high:
            raise ValueError(
                f"prompt_lookup_min ({low}) is above prompt_lookup_max ({high}); the "
                "n-gram sizes tried run from prompt_lookup_max down to prompt_lookup_min"
            )
        return self


def worker_speculation(
    config: SpeculativeDecodingConfig | None, role: str
) -> SpeculativeConfig | None:
    """The `SpeculativeConfig` a worker of `role` ("context" or "generation")
    runs with; None when off, and always on a context worker. Raises
    `SpeculativeConfigError` where the engine refuses what the schema let by."""
    if config is None or role == "context":
        return None
    return SpeculativeConfig(
        method=config.method,
        num_speculative_tokens=config.num_speculative_tokens,
        prompt_lookup_min=config.prompt_lookup_min,
        prompt_lookup_max=config.prompt_lookup_max,
    )


def describe_speculation(config: SpeculativeConfig) -> str:
    """One phrase for the plan: `ngram, 3 drafts a step from n-grams of 4 down to 2`."""
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    sizes = f"n-grams of {high}" if low == high else f"n-grams of {high} down to {low}"
    return f"{config.method}, {config.num_speculative_tokens} drafts a step from {sizes}"
