"""Host staging of pool buffers: how runs fill chunks, the strided copies, and
that staged pulls copy on the staging thread, never on the event loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvcache.spec import CacheSpec
from tests.head_shards import HYBRID_WHOLE
from tests.transfer_harness import Endpoint, check_head_slice_exchange
from transfer.python.connection import PAYLOAD_PIECE_BYTES
from transfer.python.staging import chunk_plans, chunk_views, gather, scatter
from transfer.python.transceiver import PythonTransceiver

MiB = 1 << 20


def test_short_runs_fill_chunks_whole_and_long_runs_go_a_piece_a_chunk() -> None:
    assert 8 * MiB == PAYLOAD_PIECE_BYTES
    runs = [("kv", 0, 3 * MiB, 3, 4 * MiB), ("kv", 100, 20 * MiB, 1, 20 * MiB)]
    runs.append(("ssm", 7, 1 * MiB, 2, 3 * MiB))
    assert list(chunk_plans(runs)) == [
        [("kv", 0, 3 * MiB, 2, 4 * MiB)],
        [("kv", 8 * MiB, 3 * MiB, 1, 4 * MiB)],
        [("kv", 100, 8 * MiB, 1, 8 * MiB)],
        [("kv", 100 + 8 * MiB, 8 * MiB, 1, 8 * MiB)],
        [("kv", 100 + 16 * MiB, 4 * MiB, 1, 4 * MiB)],
        [("ssm", 7, 1 * MiB, 2, 3 * MiB)],
    ]


def test_a_chunk_is_one_view_on_a_byte_stream_and_a_view_per_run_on_a_message_wire() -> None:
    chunk = torch.arange(64, dtype=torch.uint8)
    plan = [("kv", 0, 4, 3, 10), ("ssm", 5, 6, 1, 6)]
    (whole,) = chunk_views(chunk, plan, per_run=False)
    assert bytes(whole) == bytes(range(18))
    per_run = chunk_views(chunk, plan, per_run=True)
    assert [bytes(v) for v in per_run] == [
        bytes(range(0, 4)),
        bytes(range(4, 8)),
        bytes(range(8, 12)),
        bytes(range(12, 18)),
    ]


@pytest.mark.parametrize(
    "offset,run,count,stride",
    [
        (0, 64, 5, 128),  # aligned to 8: copied as int64
        (6, 6, 4, 10),  # aligned to 2 only
        (3, 5, 7, 9),  # byte-wise
    ],
)
def test_gather_and_scatter_move_strided_runs_end_to_end(
    offset: int, run: int, count: int, stride: int
) -> None:
    pool = torch.randint(0, 256, (1024,), dtype=torch.uint8)
    plan = [("kv", offset, run, count, stride), ("kv", 700, 16, 2, 40)]
    expected = np.concatenate(
        [pool.numpy()[o + i * s : o + i * s + n] for _, o, n, c, s in plan for i in range(c)]
    )
    chunk = torch.zeros(1024, dtype=torch.uint8)
    gather({"kv": pool}, plan, chunk)
    assert chunk[: expected.size].numpy().tobytes() == expected.tobytes()

    back = torch.zeros_like(pool)
    scatter({"kv": back}, plan, chunk)
    for _, o, n, c, s in plan:
        for i in range(c):
            at = o + i * s
            assert torch.equal(back[at : at + n], pool[at : at + n])
    written = sum(n * c for _, _, n, c, _ in plan)
    assert int(back.count_nonzero()) <= written  # nothing outside the runs


@pytest.fixture
def chunk_copy_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the threads each `Tensor.copy_` into or out of a staging
    chunk (an 8 MiB host allocation) runs on."""
    seen: list[str] = []
    real = torch.Tensor.copy_

    def in_chunk(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().nbytes() == PAYLOAD_PIECE_BYTES

    def recording(
        self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
    ) -> torch.Tensor:
        if in_chunk(self) or in_chunk(src):
            seen.append(threading.current_thread().name)
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recording)
    yield seen


def staged_endpoint(manager: str, spec: CacheSpec, stage: bool, num_blocks: int) -> Endpoint:
    return Endpoint(
        manager,
        lambda buffers: PythonTransceiver(buffers, b"secret", stage_through_host=stage),
        spec,
        num_blocks=num_blocks,
    )


@pytest.mark.parametrize("ctx_size,gen_size", [(1, 1), (1, 2), (2, 1)])
async def test_staged_pulls_copy_on_the_staging_thread_not_the_event_loop(
    chunk_copy_threads: list[str], ctx_size: int, gen_size: int
) -> None:
    """Whole segments and head slices (strided on either side) between staged
    pools: the bytes arrive, and every copy into or out of a staging chunk
    ran on the staging thread, none on the event loop's, where it would wait
    behind a device's running forward."""
    await check_head_slice_exchange(
        staged_endpoint, HYBRID_WHOLE, ctx_size, gen_size, ("v1", "v1"), (True, True)
    )
    assert chunk_copy_threads, "no copy went through a staging chunk"
    assert {name.split("_")[0] for name in chunk_copy_threads} == {"kv-staging"}
