"""`models.host_batch.HostBatch`: a step's lists packed on the host, moved in one copy,
and sent to other tensor-parallel ranks as one buffer."""

from __future__ import annotations

import pickle
import warnings

import torch

from models.host_batch import HostBatch

CPU = torch.device("cpu")


def _lists(mamba: bool) -> dict[str, object]:
    # A prefill chunk of 3 tokens (seq 0, fresh) and a decode token (seq 1).
    return {
        "input_ids": [11, 12, 13, 21],
        "positions": [0, 1, 2, 40],
        "query_start_loc": [0, 3, 4],
        "seq_lens": [3, 41],
        "context_lens": [0, 40],
        "block_tables": [[7], [2, 9, 4]],
        "slot_mapping": [28, 29, 30, 64],
        "block_size": 16,
        "mamba_slots": [5, 6] if mamba else None,
        "logits_indices": [2, 3],
    }


def test_the_batch_on_the_device_holds_every_list_and_pads_the_tables_with_the_null_block() -> None:
    lists = _lists(mamba=True)
    batch = HostBatch.pack(**lists).to_device(CPU)  # type: ignore[arg-type]
    assert batch.input_ids.tolist() == lists["input_ids"]
    assert batch.positions.tolist() == lists["positions"]
    assert batch.query_start_loc.tolist() == lists["query_start_loc"]
    assert batch.seq_lens.tolist() == lists["seq_lens"]
    assert batch.context_lens.tolist() == lists["context_lens"]
    assert batch.slot_mapping.tolist() == lists["slot_mapping"]
    assert batch.block_tables.tolist() == [[7, 0, 0], [2, 9, 4]]
    assert batch.block_size == 16
    assert batch.mamba_slots is not None and batch.mamba_slots.tolist() == [5, 6]
    assert batch.logits_indices is not None and batch.logits_indices.tolist() == [2, 3]
    assert batch.shape.seq_lens == (3, 41) and batch.shape.mamba_slots == (5, 6)
    # The decode token (row 3) steps its state in slot 6; slot 5 starts fresh.
    rows = batch.mamba_rows
    assert rows is not None
    assert (rows.step_rows.tolist(), rows.step_slots.tolist(), rows.fresh_slots.tolist()) == (
        [3],
        [6],
        [5],
    )


def test_lists_left_out_stay_none_and_a_wider_table_is_padded() -> None:
    lists = {**_lists(mamba=False), "logits_indices": None}
    host = HostBatch.pack(**lists, table_width=5)  # type: ignore[arg-type]
    batch = host.to_device(CPU)
    assert batch.mamba_slots is None and batch.mamba_rows is None
    assert batch.logits_indices is None and host.num_logits == 0
    assert batch.block_tables.tolist() == [[7, 0, 0, 0, 0], [2, 9, 4, 0, 0]]


def test_it_pickles_as_one_buffer_and_builds_the_same_batch_from_read_only_memory() -> None:
    host = HostBatch.pack(**_lists(mamba=True))  # type: ignore[arg-type]
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(host, protocol=5, buffer_callback=buffers.append)
    # Every index travels in one out-of-band buffer, not int by int in the pickle.
    assert len(buffers) == 1
    assert buffers[0].raw().nbytes == 8 * sum(host.spans)
    # As Ray hands an argument's buffer to the receiving rank: read-only.
    received = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])
    assert not received.packed.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a tensor over read-only memory
        mine, theirs = host.to_device(CPU), received.to_device(CPU)
    for name in ("input_ids", "positions", "block_tables", "slot_mapping", "logits_indices"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    assert theirs.shape == mine.shape


def test_every_list_starts_16_bytes_aligned_whatever_the_lengths_before_it() -> None:
    # Odd lengths everywhere: one decode token and a 5-token chunk, a 3-wide table.
    lists = {
        "input_ids": [11, 12, 13, 14, 15, 21],
        "positions": [0, 1, 2, 3, 4, 40],
        "query_start_loc": [0, 5, 6],
        "seq_lens": [5, 41],
        "context_lens": [0, 40],
        "block_tables": [[7], [2, 9, 4]],
        "slot_mapping": [28, 29, 30, 31, 32, 64],
        "block_size": 16,
        "mamba_slots": [5, 6],
        "logits_indices": [4, 5],
    }
    for cut in range(3):  # shift every later list by one element at a time
        shifted = {**lists, "input_ids": lists["input_ids"][cut:]}
        batch = HostBatch.pack(**shifted).to_device(CPU)  # type: ignore[arg-type]
        rows = batch.mamba_rows
        assert rows is not None and batch.mamba_slots is not None
        fields = {
            "positions": batch.positions,
            "query_start_loc": batch.query_start_loc,
            "seq_lens": batch.seq_lens,
            "context_lens": batch.context_lens,
            "slot_mapping": batch.slot_mapping,
            "block_tables": batch.block_tables,
            "mamba_slots": batch.mamba_slots,
            "step_rows": rows.step_rows,
            "fresh_slots": rows.fresh_slots,
        }
        misaligned = [name for name, t in fields.items() if t.data_ptr() % 16]
        assert not misaligned, (cut, misaligned)
        assert batch.seq_lens.tolist() == [5, 41] and batch.block_tables.tolist()[1] == [2, 9, 4]
