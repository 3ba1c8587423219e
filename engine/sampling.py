"""Token sampling for a batch of requests, as batched tensor ops.

`Sampler.sample` turns one row of logits per request into one token per
request. Every request carries its own `SamplingParams`; the per-row values
become tensors once per call, so the work is a fixed number of batched ops
whatever the mix of settings:

    logits --penalties--> penalized --/temperature--> --min-p--> --top-k/top-p--> probs
       |                      |                                                     |
       |                      +--> log_softmax: the reported logprobs               |
       +----------------------------------------------------- argmax (greedy rows)  |
                              first i with cdf[i] > u * cdf[-1], u ~ U[0, 1) <------+

Sampling inverts the cumulative distribution: one uniform draw `u` per row
picks the token whose slice `[cdf[i-1], cdf[i])` of the row's total mass holds
`u * cdf[-1]`, i.e. token `i` with probability `probs[i]`; a token masked to
probability 0 has an empty slice and is never picked. The sums run in
float64 and `u` is a float64 draw, so even tokens of probability ~1e-12 keep
their share. One draw per row (not one per vocabulary entry, as an
exponential race or Gumbel-max would need) matters on CPU, where torch's
generator makes each draw cost tens of nanoseconds: `Exp(1)` noise over a
whole batch's vocabulary took longer than the model's decode forward at that
size (docs/performance.md, "Sampling"). A request with a seed draws its
`u` from its own `torch.Generator`, one draw per step, so its tokens do not
depend on which other requests share the batch.

Reported logprobs follow the OpenAI / vLLM convention: `log_softmax` of the
penalized logits, before temperature and truncation, so they describe the
model's distribution rather than the sampling knobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.grammar import GrammarSpec
from engine.samples import MAX_SAMPLES
from engine.token_history import TokenHistory

MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs per token


# A request's seed is a 64-bit signed int (as vLLM's): torch's generators
# take [-2**63, 2**64) and raise on anything else, which would fail a whole
# engine step rather than the one request.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# The largest top_k: the step puts every row's top_k in one int64 tensor, and
# any value at or above the vocabulary size keeps every token anyway.
MAX_TOP_K = 2**31 - 1
# Logprobs are finite (JSON has no -inf): a token with no probability at all
# reports this, as vLLM does.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature` 0 is greedy; `top_k` 0 (or -1) and `top_p` 1 switch those
    filters off. Penalties follow vLLM: `repetition_penalty` divides positive
    (multiplies negative) logits of tokens seen in the prompt or the output;
    `presence_penalty` / `frequency_penalty` subtract once / per occurrence
    for tokens of the output. `logprobs` is how many top alternatives to
    return besides the sampled token's logprob (None: no alternatives).
    Invalid values raise `ValueError` naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Any sequence is accepted (JSON bodies give lists); stored as a tuple.
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Samples from one prefill (`engine.samples`), 1..MAX_SAMPLES.
    n: int = 1
    # Structured output (`engine.grammar`): every sampled token keeps the
    # output a prefix of the grammar's language; None: unconstrained.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Tuples, so params hash and compare by value.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an int >= 1")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_SAMPLES, "n", f"an int in [1, {MAX_SAMPLES}]")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "a float >= 0")
        _check(
            _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"an int in [0, {MAX_TOP_K}] (0 or -1: off)",
        )
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        _check(
            self.seed is None or (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED),
            "seed",
            "a 64-bit signed int or None",
        )
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "a float > 0 (1: off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, "in [-2, 2]")
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "non-negative ints",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"None or an int in [0, {MAX_LOGPROBS}]",
        )
        _check(
            self.grammar is None or isinstance(self.grammar, GrammarSpec),
            "grammar",
            "a GrammarSpec or None",
        )
        # The output ends where the grammar does: a matcher has no token to
        # offer after the end token it accepted.
        _check(
            self.grammar is None or not self.ignore_eos,
            "ignore_eos",
            "false with structured output (the output ends where the grammar does)",
        )

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, field: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} must be {expected}")


@dataclass
class SamplerOutput:
    """One sampled token per row, with its logprob and the requested top logprobs.

    `logprobs[i]` is always set (it costs one logsumexp per row);
    `top_logprobs[i]` is None unless row i asked for `logprobs`, and then holds
    `params.logprobs` (token id, logprob) pairs, most likely first.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with `seed`, for one request's sampling noise.

    torch's CPU generator keeps only the low 32 bits of its seed, so seeds
    that differ above them (-1 and 2**63 - 1, 0 and -2**63) would draw the
    same stream: the seed is mixed first (splitmix64), so every bit counts.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(_mix_seed(seed))
    return generator


def _mix_seed(seed: int) -> int:
    """splitmix64 of `seed` taken as an unsigned 64-bit integer."""
    mask = 2**64 - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


class Sampler:
    """Samples the next token of every row of a logits batch."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        """Sample from `logits` [N, V]; row i uses `params[i]` and `generators[i]`.

        `histories[i]` (the row's tokens so far, `engine.token_history`)
        feeds the penalties; None for a row without any. A row's generator is
        used only when the row samples (temperature > 0); None means the
        global torch RNG. `logits` is not modified.
        """
        rows = len(params)
        if logits.dim() != 2 or logits.shape[0] != rows:
            raise ValueError(f"logits must be [{rows}, vocab], got {list(logits.shape)}")
        if not len(histories) == len(generators) == rows:
            raise ValueError("params, histories and generators must have one entry per row")
        logits = logits.float()
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, params, histories)
        if all(p.is_greedy for p in params):
            token_ids = greedy_pick(logits)
        else:
            token_ids = self._sample_mixed(logits, params, generators)
        return _with_logprobs(logits, token_ids, params)

    def _sample_mixed(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        # Greedy rows get temperature 1 here and their argmax afterwards.
        temperature = _row_tensor([p.temperature or 1.0 for p in params], logits)
        scaled = logits / temperature.unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            scaled = apply_min_p(scaled, _row_tensor([p.min_p for p in params], logits))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
            scaled = apply_top_k_top_p(
                scaled, top_k, _row_tensor([p.top_p for p in params], logits)
            )
        # Penalties can push a logit to +inf (a repetition penalty near 0) and a
        # broken model can give NaN: +inf tokens share a row's mass evenly,
        # NaN ones get none, and a row of NaN alone takes its argmax: never
        # an id outside the vocabulary.
        probs = _finite_logits(scaled).softmax(dim=-1)
        sampled = _inverse_cdf(probs, _uniform_draws(params, generators, probs.device))
        no_mass = probs[:, 0].isnan()  # softmax of a row of NaN logits
        return torch.where(greedy | no_mass, greedy_pick(logits), sampled)


# Width of the slices `greedy_pick` reduces first; 256 was fastest on
# vocabularies of 32,000 to 50,257 tokens.
GREEDY_SLICE = 256


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of a [N, V] tensor, the same index, cheaper on CPU.

    Other devices, and rows shorter than two slices, use `argmax` itself.

    torch's CPU argmax tracks an index per element and does not vectorize:
    it took over ten times what `amax` takes over the same logits
    (docs/performance.md, "Sampling"). So each row is cut into slices of
    `GREEDY_SLICE` values: a vectorized `amax` per slice, `argmax` over the
    few slice maxima (the first slice holding the row's maximum), then
    `argmax` inside that slice alone. Ties and NaN resolve as in `argmax`: `amax`
    propagates NaN, and both argmaxes take the first maximum, so the result
    is the first occurrence of the row's maximum (or of its first NaN).

        row:    [ s0 | s1 | s2 | ... | s(k-1) | tail ]   each s: GREEDY_SLICE values
        maxima: [ m0   m1   m2   ...   m(k-1)   mt   ]   -> first max: slice j
        token:  j * GREEDY_SLICE + argmax(s_j)
    """
    rows, vocab = logits.shape
    width = GREEDY_SLICE
    whole = vocab // width
    if whole < 2 or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    maxima = logits[:, : whole * width].unflatten(1, (whole, width)).amax(dim=-1)
    if whole * width < vocab:
        tail = logits[:, whole * width :].amax(dim=-1, keepdim=True)
        maxima = torch.cat([maxima, tail], dim=1)
    first = maxima.argmax(dim=-1, keepdim=True)
    # The tail slice is shorter: its columns past the row's end repeat the
    # last one, which cannot come before the tail's own first maximum.
    columns = first * width + torch.arange(width, device=logits.device)
    columns = columns.clamp_(max=vocab - 1)
    return first.squeeze(1) * width + logits.gather(1, columns).argmax(dim=-1)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
) -> torch.Tensor:
    """Repetition, presence and frequency penalties as batched ops; returns new logits.

    Only the columns of tokens a row has seen change, so the work is over
    those (gathered, penalized, scattered back), not over the vocabulary:
    full-width masks and selects took longer than a whole decode step of a
    small model (docs/performance.md, "Sampling"). Each
    row's history lists a token once, with its count in the output.
    """
    rows, vocab = logits.shape
    # One spare column: the padding of shorter rows lands there and is dropped.
    out = torch.cat([logits, logits.new_zeros(rows, 1)], dim=1)
    width = max((len(h.ids) for h in histories if h is not None), default=0)
    seen = np.full((rows, width), vocab, dtype=np.int64)
    times = np.zeros((rows, width), dtype=np.float32)
    for row, history in enumerate(histories):
        if history is not None:
            if history.vocab != vocab:
                raise ValueError(f"a history of vocabulary {history.vocab} for {vocab} logits")
            seen[row, : len(history.ids)] = history.ids
            times[row, : len(history.ids)] = history.counts
    index = torch.from_numpy(seen).to(logits.device)
    counts = torch.from_numpy(times).to(device=logits.device, dtype=logits.dtype)
    values = out.gather(1, index)
    repetition = _row_tensor([p.repetition_penalty for p in params], logits).unsqueeze(1)
    values = torch.where(values > 0, values / repetition, values * repetition)
    frequency = _row_tensor([p.frequency_penalty for p in params], logits).unsqueeze(1)
    presence = _row_tensor([p.presence_penalty for p in params], logits).unsqueeze(1)
    values = values - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return out.scatter_(1, index, values)[:, :vocab]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p[row]` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, -math.inf)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep each row's `top_k` best tokens (0: all), then its smallest set of mass >= `top_p`.

    One descending sort serves both filters; the most likely token always
    survives, so no row is left empty.
    """
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    ordered = ordered.masked_fill(rank >= k, -math.inf)
    probs = ordered.softmax(dim=-1)
    # A token is dropped when the mass strictly before it already reaches top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 are exempt: rounding can push the cumulative sum
    # past 1.0 and would otherwise clip their tail.
    cut = (mass_before >= top_p.unsqueeze(1)) & (rank > 0) & (top_p < 1).unsqueeze(1)
    ordered = ordered.masked_fill(cut, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(-1, order, ordered)


def _row_tensor(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _uniform_draws(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """One float64 U[0, 1) draw per row; a seeded row draws from its own generator.

    A seeded row takes exactly one value per step from its generator (on the
    generator's device), whatever else is in the batch. Unseeded rows share
    one draw from the global RNG; greedy rows' values go unused. The seeded
    values stay tensors: reading each back would stall a GPU once per row.
    """
    draws = torch.rand(len(params), dtype=torch.float64).to(device)
    seeded = [
        row
        for row, (p, generator) in enumerate(zip(params, generators, strict=True))
        if generator is not None and not p.is_greedy
    ]
    if seeded:
        values = [draw_uniform(generators[row]).to(device) for row in seeded]  # type: ignore[arg-type]
        draws[torch.tensor(seeded, device=device)] = torch.cat(values)
    return draws


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """One U[0, 1) value `[1]` from a seeded row's generator, on its device:
    what a sampling step takes from it per row (`_uniform_draws`)."""
    return torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)


def _finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """+inf as the dtype's largest value (such tokens share the mass), -inf as
    its lowest (no mass, unless the whole row is -inf: then even shares), and
    NaN as -inf (no mass; a row of NaN has none at all)."""
    return torch.nan_to_num(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first index whose cumulative mass exceeds `uniform[i]` of the row's total."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    # Kept below the total, which `u * total` can round up to when u is near 1:
    # the search then ends on the last token with mass, never past it.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniform * total, below_total).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> SamplerOutput:
    """Attach the sampled tokens' logprobs and the requested top logprobs.

    Both are None for every row when no row asks for logprobs: the
    `log_softmax` over the vocabulary is then skipped.
    """
    if all(p.logprobs is None for p in params):
        ids = [int(t) for t in token_ids.tolist()]
        return SamplerOutput(
            token_ids=ids, logprobs=[None] * len(ids), top_logprobs=[None] * len(ids)
        )
    logprobs = _finite_logits(logits).log_softmax(dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=MIN_LOGPROB).clamp_(min=MIN_LOGPROB)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top: list[list[tuple[int, float]] | None] = [None] * len(params)
    most = max((p.logprobs or 0 for p in params), default=0)
    if any(p.logprobs is not None for p in params):
        values, indices = logprobs.topk(most, dim=-1) if most else (None, None)
        for row, p in enumerate(params):
            if p.logprobs is None:
                continue
            if values is None or indices is None or p.logprobs == 0:
                top[row] = []
                continue
            pairs = zip(
                indices[row, : p.logprobs].tolist(),
                values[row, : p.logprobs].tolist(),
                strict=True,
            )
            top[row] = [(int(t), float(v)) for t, v in pairs]
    return SamplerOutput(
        token_ids=[int(t) for t in token_ids.tolist()],
        logprobs=[float(v) for v in sampled.tolist()],
        top_logprobs=top,
    )
