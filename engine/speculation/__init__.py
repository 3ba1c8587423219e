"""Speculative decoding: drafters propose tokens, one verify forward accepts a
prefix of them (`engine.speculation.verify`); the scheduler and the runner
only carry the drafts.

    config     `SpeculativeConfig`, the resolved per-worker settings
    ngram      prompt lookup: the continuation of the sequence's latest
               earlier match of its own last n tokens
    drafts     per-request drafting state: proposals, acceptance, back-off
    verify     which drafts a verify step accepts, from the tokens it sampled
"""
