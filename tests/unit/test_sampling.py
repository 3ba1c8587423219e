"""Batched sampling: filters, penalties, seeded draws and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import (
    MAX_SEED,
    MIN_LOGPROB,
    MIN_SEED,
    Sampler,
    SamplingParams,
    _inverse_cdf,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    greedy_pick,
    make_generator,
)
from engine.token_history import TokenHistory
from models.host_reads import count_host_reads

VOCAB = 32


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> list[int]:
    n = len(params)
    histories = _histories(prompts or [[1]] * n, outputs or [[]] * n, logits.shape[1])
    out = Sampler().sample(logits, params, histories, generators or [None] * n)
    return out.token_ids


def _histories(
    prompts: list[list[int]], outputs: list[list[int]], vocab: int
) -> list[TokenHistory | None]:
    histories: list[TokenHistory | None] = []
    for prompt, output in zip(prompts, outputs, strict=True):
        history = TokenHistory(prompt, vocab)
        for end in range(len(output) + 1):  # one token a step, as a request grows
            history.sync(output[:end])
        histories.append(history)
    return histories


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, VOCAB, generator=make_generator(0))
    tokens = _sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    logits = torch.randn(8, VOCAB, generator=make_generator(1))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    generators: list[torch.Generator | None] = [make_generator(i) for i in range(8)]
    assert _sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_greedy_and_sampled_rows_mix() -> None:
    logits = torch.randn(4, VOCAB, generator=make_generator(2))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(),
        SamplingParams(temperature=0.0),
    ]
    tokens = _sample(logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    assert tokens[0] == argmax[0] and tokens[1] == argmax[1] and tokens[3] == argmax[3]


def test_top_k_and_top_p_masks_per_row() -> None:
    row = _logits_of([0.5, 0.3, 0.15, 0.05])
    logits = row.repeat(4, 1)
    top_k = torch.tensor([0, 2, 0, 3])
    top_p = torch.tensor([0.75, 1.0, 1.0, 0.5])
    kept = apply_top_k_top_p(logits, top_k, top_p).isfinite().tolist()
    assert kept == [
        [True, True, False, False],  # mass before token 2 is 0.8 >= 0.75
        [True, True, False, False],  # top-2
        [True, True, True, True],  # filters off
        [True, False, False, False],  # top-3, then 0.5 mass reached after token 0
    ]


def test_top_p_keeps_the_most_likely_token_even_below_the_mass() -> None:
    logits = _logits_of([0.4, 0.35, 0.25])
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.1])).isfinite()
    assert kept.tolist() == [[True, False, False]]


def test_min_p_mask() -> None:
    logits = _logits_of([0.5, 0.3, 0.15, 0.05]).repeat(2, 1)
    kept = apply_min_p(logits, torch.tensor([0.2, 0.5])).isfinite().tolist()
    assert kept == [[True, True, True, False], [True, True, False, False]]


def test_sampled_tokens_stay_inside_the_filters() -> None:
    logits = torch.randn(1, VOCAB, generator=make_generator(3)).repeat(200, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=3)] * 200
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tokens = _sample(logits, params)
    assert set(tokens) <= allowed and len(set(tokens)) == 3


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    result = apply_penalties(logits, [params], _histories([[0]], [[1, 3, 3]], 5))
    # token 0: prompt only -> 2/2; token 1: -1*2 - 0.25*1 - 0.5; token 3: 3/2 - 0.25*2 - 0.5
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.5, -2.0]])
    torch.testing.assert_close(result, expected)


def _penalized_by_hand(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    row = logits.clone()
    vocab = row.shape[0]
    counts = {t: output.count(t) for t in output if 0 <= t < vocab}
    for token in {t for t in prompt + output if 0 <= t < vocab}:
        value = row[token].item()
        value = (
            value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        )
        times = counts.get(token, 0)
        value -= params.frequency_penalty * times + params.presence_penalty * (times > 0)
        row[token] = value
    return row


def test_penalties_of_a_batch_match_a_token_by_token_loop() -> None:
    """Rows of different lengths (one empty), repeated and out-of-range ids,
    -inf logits and a row without penalties, against a plain loop."""
    rng = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(5, vocab, generator=rng) * 3
    logits[1, :5] = -math.inf
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, presence_penalty=-1.0),
    ]
    prompts = [[1, 2, 2, 49], [0, 3, 7], [], [4, 5], [vocab, -1, 6] + list(range(10, 40))]
    outputs = [[2, 2, 8, 8, 8], [1, 4], [9, 9, vocab + 3], [], [6, 6, 11, 45]]
    histories = _histories(prompts, outputs, vocab)
    histories[3] = None  # a row without penalties keeps no history
    result = apply_penalties(logits, params, histories)
    for row in range(5):
        expected = _penalized_by_hand(logits[row], params[row], prompts[row], outputs[row])
        torch.testing.assert_close(result[row], expected)
    assert result.shape == logits.shape


def test_penalties_change_the_greedy_choice_and_logprobs() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0)]
    out = Sampler().sample(logits, params, _histories([[2]], [[0]], 4), [None])
    assert out.token_ids == [1]
    penalized = torch.tensor([2.0, 2.9, 0.0, -1.0])
    assert out.logprobs[0] == pytest.approx(penalized.log_softmax(-1)[1].item(), abs=1e-6)
    assert torch.equal(logits, torch.tensor([[3.0, 2.9, 0.0, -1.0]]))  # input untouched


def test_seeded_request_is_independent_of_batch_composition() -> None:
    logits = torch.randn(1, VOCAB, generator=make_generator(4))
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=123)

    def run(batch_size: int, position: int) -> list[int]:
        generator = make_generator(123)
        tokens = []
        for step in range(12):
            others = torch.randn(batch_size, VOCAB, generator=make_generator(100 + step))
            others[position] = logits[0]
            params = [SamplingParams(temperature=0.7)] * batch_size
            generators: list[torch.Generator | None] = [make_generator(step + 9)] * batch_size
            params[position], generators[position] = target, generator
            if batch_size > 2:
                params[0 if position else 1] = SamplingParams(temperature=0.0)
            tokens.append(_sample(others, params, generators)[position])
        return tokens

    alone = run(1, 0)
    assert run(4, 2) == alone
    assert run(3, 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_seeded_rows_are_drawn_without_a_host_read_each() -> None:
    """A step's only read back is its sampled ids: seeded rows' draws stay
    on the device (on a GPU a read per row would stall the stream per row)."""
    logits = torch.randn(4, VOCAB, generator=make_generator(5))
    params = [SamplingParams(temperature=1.0, seed=row) for row in range(3)]
    params.append(SamplingParams(temperature=0.8))
    generators: list[torch.Generator | None] = [make_generator(row) for row in range(3)]
    with count_host_reads("cpu") as reads:
        tokens = _sample(logits, params, [*generators, None])
    assert reads.names == ["Tensor.tolist"]
    # The same draws as one value per seeded row from fresh generators.
    again = _sample(logits, params, [*(make_generator(row) for row in range(3)), None])
    assert tokens[:3] == again[:3]


def test_seeded_draws_follow_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = _logits_of(probs)
    generator = make_generator(2024)
    draws = 4000
    counts = [0] * 4
    for _ in range(draws):
        counts[_sample(logits, [SamplingParams(seed=2024)], [generator])[0]] += 1
    chi2 = sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(counts, probs, strict=True))
    assert chi2 < 16.27  # 99.9% quantile, 3 degrees of freedom


def test_extreme_draws_never_land_on_a_masked_token() -> None:
    # The first and last tokens are masked (probability 0); draws at both ends
    # of [0, 1) must still pick the tokens with mass next to them.
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0]]).repeat(3, 1)
    uniform = torch.tensor([0.0, 0.25 - 1e-12, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    assert _inverse_cdf(probs, uniform).tolist() == [1, 1, 2]


def test_temperature_sharpens_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 4000
    logits = probs.log().repeat(rows, 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        tokens = _sample(logits, [SamplingParams(temperature=0.5)] * rows)
    expected = probs**2 / (probs**2).sum()
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float()
    chi2 = ((counts - rows * expected) ** 2 / (rows * expected)).sum().item()
    assert chi2 < 16.27


def test_no_logprobs_are_computed_when_no_row_asks() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [0.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits, params, [None, None], [None, None])
    assert out.token_ids == [0, 2]
    assert out.logprobs == [None, None] and out.top_logprobs == [None, None]


def test_logprobs_and_top_logprobs() -> None:
    logits = torch.randn(3, VOCAB, generator=make_generator(5))
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler().sample(logits, params, [None] * 3, [None] * 3)
    reference = logits.log_softmax(-1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(reference[row, token].item(), abs=1e-6)
    top = out.top_logprobs[0]
    assert top is not None and [t for t, _ in top] == reference[0].topk(3).indices.tolist()
    assert top[0][1] >= top[1][1] >= top[2][1]
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None


def test_params_validation_names_the_field() -> None:
    for field, value in [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("logprobs", 21),
        ("stop", ("",)),
        ("temperature", math.nan),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("top_k", 2**70),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_every_64_bit_seed_seeds_a_generator() -> None:
    """Each seed of the 64-bit range is accepted and gives its own stream,
    the same one each time it is given."""
    streams = []
    for seed in (MIN_SEED, -1, 0, MAX_SEED):
        assert SamplingParams(seed=seed).seed == seed
        first = torch.rand(4, generator=make_generator(seed))
        assert torch.equal(first, torch.rand(4, generator=make_generator(seed)))
        streams.append(tuple(first.tolist()))
    assert len(set(streams)) == len(streams)


def test_infinite_and_nan_logits_never_give_an_id_outside_the_vocabulary() -> None:
    vocab = 8
    inf, nan = math.inf, math.nan
    logits = torch.zeros(4, vocab)
    logits[0, [2, 5]] = inf  # two +inf tokens (a repetition penalty near 0) share the mass
    logits[1, 3] = nan  # one NaN token gets none
    logits[2] = nan  # no mass left: the row's argmax
    logits[3] = -inf
    params = [SamplingParams(temperature=1.0, seed=row) for row in range(4)]
    seen: set[int] = set()
    for draw in range(40):
        generators = [make_generator(1000 * row + draw) for row in range(4)]
        tokens = _sample(logits, params, generators)
        assert all(0 <= t < vocab for t in tokens)
        assert tokens[0] in (2, 5) and tokens[1] != 3
        seen.add(tokens[0])
    assert seen == {2, 5}
    # Their logprobs are finite numbers (JSON has no NaN or -inf).
    with_logprobs = [SamplingParams(temperature=1.0, seed=row, logprobs=3) for row in range(4)]
    out = Sampler().sample(logits, with_logprobs, [None] * 4, [None] * 4)
    values = out.logprobs + [v for row in out.top_logprobs for _, v in row or []]
    assert all(math.isfinite(v) and v >= MIN_LOGPROB for v in values)
    assert out.logprobs[0] == pytest.approx(math.log(0.5))


def test_params_normalize_lists_and_top_k_off() -> None:
    params = SamplingParams(stop=["a"], stop_token_ids=[7], top_k=-1)
    assert params.stop == ("a",) and params.stop_token_ids == (7,) and params.top_k == 0
    assert hash(params) == hash(SamplingParams(stop=("a",), stop_token_ids=(7,)))
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy


def test_mismatched_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, VOCAB), [SamplingParams()], [None], [None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab", [49152, 32000, 50257, 600, 300, 7])
def test_greedy_pick_is_argmax(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen).to(dtype)
    # Ties: row 1 repeats its maximum in a later slice and right after it;
    # row 2 is constant; row 3 peaks in the last column; row 4 is all -inf;
    # rows 5 and 6 hold NaN (argmax takes the first NaN); row 7 peaks in the
    # first column; row 8 rounds to few distinct values (many ties).
    logits[1, vocab // 3] = logits[1, -1] = logits[1, vocab // 3 + 1] = 50.0
    logits[2] = 1.0
    logits[3, -1] = 60.0
    logits[4] = -math.inf
    logits[5, vocab // 2] = math.nan
    logits[5, vocab - 1] = math.nan
    logits[6, 0] = 70.0
    logits[6, vocab - 2] = math.nan
    logits[7, 0] = 80.0
    logits[8] = logits[8].round()
    assert torch.equal(greedy_pick(logits), logits.argmax(dim=-1))


def test_greedy_pick_of_no_rows() -> None:
    assert greedy_pick(torch.zeros(0, 1000)).shape == (0,)
