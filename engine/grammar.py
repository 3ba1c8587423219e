"""Structured output: a grammar constrains which tokens a request may sample.

A request's `SamplingParams.grammar` is a `GrammarSpec`: a JSON schema, any
JSON value (`json_object`), a regular expression, a list of choices, or an
EBNF grammar. xgrammar compiles it against the model's vocabulary; a
`GrammarMatcher` per request then gives, before each sampling step, the
bitmask of tokens that keep the output a prefix of the grammar's language
(and, once the grammar is complete, only the end-of-sequence tokens), and
`GrammarBook.mask` sets every other logit to -inf before the sampler sees
the row. So the output parses whatever the model's preferences, and a
finished request's text is a whole sentence of the grammar (unless
`max_tokens` cut it).

Where a matcher stands is read off the request itself: it has accepted the
first `accepted` output tokens, and before each mask it accepts the rest.
Those are the tokens the last step committed, or on a generation worker the
first token the context worker sampled under the same grammar, or a forked
sample's own first token; after a preemption the output is unchanged. So
the state always equals the committed output, through P/D, n samples and
recompute, with no message of its own.

Speculative decoding: a verify step samples k + 1 positions. Position j's
mask is the state after the output and the first j drafts, so every
position is sampled exactly as plain decoding would sample there. The
drafts are accepted into the matcher only to fill those masks and rolled
back at once; the committed tokens are accepted at the next step as
above, so the matcher advances by accepted tokens only. A draft the
grammar refuses ends the filling: its own position's mask excludes it,
so the verify rejects it there, and the later positions (copies of the
last mask) are discarded.

JSON is generated compact (no free whitespace between tokens): a model
left free to add whitespace can emit it until `max_tokens`, and small
models do.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import xgrammar

    from engine.request import Request
    from models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
# Compiled grammars kept per worker, least recently used dropped first.
COMPILED_CACHE_SIZE = 256
# A matcher rolls back at most this many tokens: the drafts of one verify.
MAX_ROLLBACK = 16


class GrammarError(ValueError):
    """A grammar that does not compile; the message says where."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    kind: one of `KINDS`.
    source: the JSON schema's text (`json_schema`), the regular expression
        (`regex`), the EBNF grammar with a `root` rule (`ebnf`), the choices
        as a JSON list of strings (`choice`); empty for `json_object`.
    """

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            choices = json.loads(self.source)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice grammars need a non-empty list of non-empty strings")

    @classmethod
    def choices(cls, options: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return cls("json_schema", text)

    def ebnf(self) -> str | None:
        """The EBNF text of an `ebnf` or `choice` spec (None for the others)."""
        if self.kind == "ebnf":
            return self.source
        if self.kind == "choice":
            options = json.loads(self.source)
            return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        return None


def check_grammar(spec: GrammarSpec) -> None:
    """Raise `GrammarError` when `spec` does not compile (no vocabulary
    needed: the HTTP edge calls it to answer 400 before anything runs)."""
    _parsed(spec)


@functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)
def _parsed(spec: GrammarSpec) -> xgrammar.Grammar:
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        ebnf = spec.ebnf()
        assert ebnf is not None
        return xgr.Grammar.from_ebnf(ebnf)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(_reason(exc)) from None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ timestamp and source location."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", text) or type(exc).__name__


def vocabulary(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> Any:
    """xgrammar's view of the model's vocabulary: each token's text in the
    tokenizer's own encoding (byte-level, byte-fallback or plain, as
    xgrammar detects it), `vocab_size` logits wide (ids past the tokenizer's
    are never allowed), special tokens blanked so a grammar can never emit
    one, and `stop_ids` as the tokens that end a complete output."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend
    stops = list(stop_ids)
    detected = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=backend),
        vocab_size=vocab_size,
        stop_token_ids=stops,
    )
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    encoded = [""] * vocab_size
    for piece, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size and index not in special:
            encoded[index] = piece
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=detected.add_prefix_space,
    )


class _Matcher:
    """One request's matcher and how many of its output tokens it has taken."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.accepted = 0

    def sync(self, output: Sequence[int]) -> bool:
        """Accept the committed tokens it has not seen; False if the grammar
        refuses one (the output left the grammar: nothing sampled here does)."""
        for token in output[self.accepted :]:
            if not self.matcher.accept_token(token):
                return False
            self.accepted += 1
        return True


class GrammarBook:
    """Compiled grammars of one worker, a matcher per constrained request,
    and the masks of each sampling step (see the module docstring).

    The vocabulary table is built on first use from a thread started at
    construction, so an engine start does not wait for it and the first
    constrained request rarely does.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = tuple(stop_ids)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._matchers: dict[str, _Matcher] = {}
        self._broken: set[str] = set()
        self.num_compiled = 0
        threading.Thread(target=self._compiler_ready, name="grammar-vocab", daemon=True).start()

    def _compiler_ready(self) -> Any:
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                info = vocabulary(self._tokenizer, self.vocab_size, self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (cached by spec); `GrammarError`
        if it does not compile."""
        found = self._compiled.get(spec)
        if found is not None:
            self._compiled.move_to_end(spec)
            return found
        grammar = _parsed(spec)
        try:
            compiled = self._compiler_ready().compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(_reason(exc)) from None
        self.num_compiled += 1
        self._compiled[spec] = compiled
        if len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def admit(self, request: Request) -> None:
        """Compile a constrained request's grammar before it runs (raises
        `GrammarError`); nothing for an unconstrained one."""
        spec = request.params.grammar
        if spec is not None:
            self.compile(spec)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._broken.discard(request_id)

    def mask(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        prefixes: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """`logits` [rows, V] with every token the grammar of row i's request
        refuses at -inf; row i samples after the request's output followed
        by `prefixes[i]` (a verify's first drafts). Returns `logits` itself when no row is constrained,
        else a new tensor."""
        import xgrammar as xgr

        rows = [i for i, r in enumerate(requests) if r.params.grammar is not None]
        if not rows:
            return logits
        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        for i in rows:
            self._fill(bitmask, i, requests[i], prefixes[i])
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(
            masked, bitmask.to(masked.device), vocab_size=self.vocab_size, indices=rows
        )
        return masked

    def _fill(
        self, bitmask: torch.Tensor, row: int, request: Request, prefix: Sequence[int]
    ) -> None:
        state = self._matcher(request)
        if state is None:  # the output left the grammar: only an end token
            self._only_stops(bitmask, row)
            return
        matcher = state.matcher
        taken = 0
        for draft in prefix:
            if matcher.is_terminated() or not matcher.accept_token(draft):
                break
            taken += 1
        if taken < len(prefix) or matcher.is_terminated():
            # After a refused draft (the verify rejects it at its own
            # position, so this row is discarded) or a complete output.
            self._only_stops(bitmask, row)
        else:
            matcher.fill_next_token_bitmask(bitmask, row)
        if taken:
            matcher.rollback(taken)

    def _only_stops(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for token in self._stop_ids:
            words[token // 32] |= 1 << (token % 32)
        # int32 words: bit 31 is the sign bit.
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words])

    def _matcher(self, request: Request) -> _Matcher | None:
        import xgrammar as xgr

        rid = request.request_id
        if rid in self._broken:
            return None
        state = self._matchers.get(rid)
        if state is None:
            spec = request.params.grammar
            assert spec is not None
            matcher = xgr.GrammarMatcher(self.compile(spec), max_rollback_tokens=MAX_ROLLBACK)
            state = self._matchers[rid] = _Matcher(matcher)
        if not state.sync(request.output_token_ids):
            logger.error(
                "request %s: its output left its grammar at token %d; it may only end now",
                rid,
                state.accepted,
            )
            self._broken.add(rid)
            del self._matchers[rid]
            return None
        return state
