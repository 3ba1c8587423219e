"""Which drafts a verify step accepts.

A verify step computes the logits after the request's last token and after
each of its k drafts, and samples a token at every one of those k + 1
positions exactly as a plain decode step would sample there (same
temperature, truncation and, for a seeded request, the same draw of its
generator for the same output index: `engine.model_runner`). The drafts are
accepted up to the first position whose sampled token differs from the
draft; that position's sampled token is the bonus token, and every later
position is discarded:

    drafts:    d1  d2  d3
    sampled:   d1  d2  x   y      -> accepted d1 d2, bonus x (y discarded)

This is exactly the output of plain decoding, greedy or sampled: position j
is only used when every earlier draft equalled what plain decoding would
have produced there, and then its distribution is plain decoding's.
It is the rejection sampling of speculative decoding for drafts that are one
token each (a drafter that proposes token d with probability 1): accept d
with probability p(d), else sample from p with d removed and renormalized;
together that draws every token with probability p.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading `drafts` the `sampled` tokens (one per position,
    `len(drafts) + 1` of them) confirm."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens")
    accepted = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted
