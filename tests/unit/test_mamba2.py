"""Mamba2: the chunked SSD scan against a sequential recurrence, and the mixer
against transformers' Nemotron-H mixer over chunked prefill and decode."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from kvcache.views import MambaLayerCache
from models.batch import ForwardBatch
from models.config import MambaConfig
from models.kernels import cpu_build, dispatch
from models.layers.mamba2 import Mamba2Mixer
from models.layers.ssd import ssd_chunked_scan

HEADS, HEAD_DIM, STATE = 4, 8, 16


def sequential_recurrence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook recurrence, one token and one head at a time."""
    heads_per_group = x.shape[1] // B.shape[1]
    state = state.clone()
    ys = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            g = h // heads_per_group
            state[h] = torch.exp(dt[t, h] * A[h]) * state[h] + dt[t, h] * torch.outer(
                x[t, h], B[t, g]
            )
            ys[t, h] = state[h] @ C[t, g]
    return ys, state


def random_inputs(
    length: int, groups: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(length, HEADS, generator=gen))
    A = -torch.rand(HEADS, generator=gen) * 2 - 0.1
    B = torch.randn(length, groups, STATE, generator=gen)
    C = torch.randn(length, groups, STATE, generator=gen)
    return x, dt, A, B, C


@pytest.mark.parametrize(
    ("length", "chunk_size", "groups", "with_state"),
    [(1, 8, 1, False), (7, 8, 2, True), (16, 8, 1, True), (37, 16, 2, False), (37, 4, 4, True)],
)
def test_chunked_scan_matches_sequential_recurrence(
    length: int, chunk_size: int, groups: int, with_state: bool
) -> None:
    x, dt, A, B, C = random_inputs(length, groups, seed=length * 31 + chunk_size)
    initial = (
        torch.randn(HEADS, HEAD_DIM, STATE) if with_state else torch.zeros(HEADS, HEAD_DIM, STATE)
    )

    y, final = ssd_chunked_scan(
        x, dt, A, B, C, chunk_size, initial_state=initial if with_state else None
    )
    y_ref, final_ref = sequential_recurrence(x, dt, A, B, C, initial)

    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


def test_chunked_scan_split_anywhere_equals_one_pass() -> None:
    x, dt, A, B, C = random_inputs(29, 2, seed=5)
    y_full, final_full = ssd_chunked_scan(x, dt, A, B, C, 8)
    y_a, mid = ssd_chunked_scan(x[:11], dt[:11], A, B[:11], C[:11], 8)
    y_b, final = ssd_chunked_scan(x[11:], dt[11:], A, B[11:], C[11:], 8, initial_state=mid)

    torch.testing.assert_close(torch.cat([y_a, y_b]), y_full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_full, rtol=1e-4, atol=1e-4)


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_chunked_scan_launches_as_many_ops_for_any_number_of_chunks() -> None:
    """The state is carried across blocks in one product: a long prompt
    launches no more kernels than a short one (a loop over blocks added
    ops per block)."""
    counts = []
    for length in (16, 128):
        x, dt, A, B, C = random_inputs(length, 2, seed=length)
        with _OpCount() as ops:
            ssd_chunked_scan(x, dt, A, B, C, 8, initial_state=torch.zeros(HEADS, HEAD_DIM, STATE))
        counts.append(ops.count)
    assert counts[0] == counts[1], counts


# --- the mixer against transformers -------------------------------------------------------

HIDDEN = 32


def hf_config(n_groups: int, chunk_size: int) -> NemotronHConfig:
    return NemotronHConfig(
        vocab_size=16,
        hidden_size=HIDDEN,
        layers_block_type=["linear_attention"],
        mamba_num_heads=HEADS,
        mamba_head_dim=HEAD_DIM,
        ssm_state_size=STATE,
        n_groups=n_groups,
        conv_kernel=4,
        chunk_size=chunk_size,
        # transformers clamps dt at time_step_min in its multi-token path only;
        # a negligible minimum makes both of its paths follow our single rule.
        time_step_min=1e-9,
    )


def mixer_pair(n_groups: int, chunk_size: int) -> tuple[NemotronHMamba2Mixer, Mamba2Mixer]:
    config = hf_config(n_groups, chunk_size)
    torch.manual_seed(0)
    reference = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        reference.A_log.copy_(torch.rand(HEADS).log())
    ours = Mamba2Mixer(
        HIDDEN,
        MambaConfig(
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            state_size=STATE,
            n_groups=n_groups,
            conv_kernel=4,
            chunk_size=chunk_size,
        ),
    )
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def step_batch(steps: list[tuple[int, int, int]]) -> ForwardBatch:
    """A batch of `(slot, context_len, num_new_tokens)` per sequence; only the
    fields a Mamba mixer reads are meaningful."""
    query = torch.tensor([n for _, _, n in steps])
    context = torch.tensor([c for _, c, _ in steps])
    total = int(query.sum())
    return ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.long),
        positions=torch.zeros(total, dtype=torch.long),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), query.cumsum(0)]),
        seq_lens=context + query,
        context_lens=context,
        block_tables=torch.zeros(len(steps), 1, dtype=torch.long),
        slot_mapping=torch.zeros(total, dtype=torch.long),
        block_size=16,
        mamba_slots=torch.tensor([s for s, _, _ in steps]),
    )


@pytest.fixture(params=["c-kernels", "torch"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Decode steps through the C Mamba step kernel (prepacked projections), or
    through torch alone (`DISAGG_CPU_KERNELS=0`, plain layers)."""
    monkeypatch.setenv(cpu_build.ENABLE_ENV, "1" if request.param == "c-kernels" else "0")
    dispatch.reread_kernel_switches()
    yield request.param
    monkeypatch.undo()
    dispatch.reread_kernel_switches()


@pytest.mark.parametrize(("n_groups", "chunk_size"), [(1, 8), (2, 16)])
def test_mixer_matches_transformers_over_chunks_and_decode(
    n_groups: int, chunk_size: int, cpu_kernels: str
) -> None:
    reference, ours = mixer_pair(n_groups, chunk_size)
    if cpu_kernels == "c-kernels":
        ours.fuse_projections()
    lengths = {2: 27, 0: 9}  # slot -> total tokens
    hidden = {slot: torch.randn(n, HIDDEN) for slot, n in lengths.items()}
    with torch.no_grad():
        expected = {s: reference(h[None])[0] for s, h in hidden.items()}

    cache = MambaLayerCache(
        conv_state=torch.randn(4, ours.conv_dim, 3),  # garbage: fresh sequences must clear it
        ssm_state=torch.randn(4, HEADS, HEAD_DIM, STATE),
    )
    # Slot 2 prefills in uneven chunks (5, 11, 1, 3) while slot 0 prefills 6 and
    # then decodes; the last steps mix decode tokens of both.
    schedule = [
        [(2, 0, 5), (0, 0, 6)],
        [(2, 5, 11), (0, 6, 1)],
        [(0, 7, 1), (2, 16, 1)],
        [(2, 17, 3), (0, 8, 1)],
        *[[(2, ctx, 1)] for ctx in range(20, 27)],
    ]
    produced: dict[int, list[torch.Tensor]] = {0: [], 2: []}
    with torch.no_grad():
        for steps in schedule:
            batch = step_batch(steps)
            tokens = torch.cat([hidden[s][c : c + n] for s, c, n in steps])
            out = ours(tokens, batch, cache)
            for i, (slot, _, _) in enumerate(steps):
                start, end = batch.query_start_loc[i : i + 2].tolist()
                produced[slot].append(out[start:end])

    for slot, chunks in produced.items():
        got = torch.cat(chunks)
        scale = expected[slot].abs().max()
        torch.testing.assert_close(got / scale, expected[slot] / scale, rtol=0, atol=1e-5)


def test_time_step_limit_applies_to_prefill_and_decode_alike() -> None:
    _, unclamped = mixer_pair(n_groups=2, chunk_size=8)
    clamped = Mamba2Mixer(
        HIDDEN,
        MambaConfig(
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            state_size=STATE,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            time_step_limit=(0.4, 0.6),
        ),
    )
    clamped.load_state_dict(unclamped.state_dict())
    hidden = torch.randn(12, HIDDEN)

    def run(mixer: Mamba2Mixer, token_by_token: bool) -> torch.Tensor:
        cache = MambaLayerCache(
            conv_state=torch.zeros(1, mixer.conv_dim, 3),
            ssm_state=torch.zeros(1, HEADS, HEAD_DIM, STATE),
        )
        with torch.no_grad():
            if not token_by_token:
                return mixer(hidden, step_batch([(0, 0, 12)]), cache)
            steps = [mixer(hidden[t : t + 1], step_batch([(0, t, 1)]), cache) for t in range(12)]
            return torch.cat(steps)

    prefill, decode = run(clamped, False), run(clamped, True)
    torch.testing.assert_close(decode, prefill, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(prefill, run(unclamped, False), atol=1e-3)
