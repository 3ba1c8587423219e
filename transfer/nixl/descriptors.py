"""Prepared NIXL descriptor lists, built once per pool and indexed per request.

NIXL transfers are fastest when both sides' descriptor lists are *prepared*
once (`prep_xfer_dlist`) and each request just names indices into them. A
manager's coarse descriptors tile each buffer with equal items (V2: "kv" in
whole blocks, "mamba" in whole slots; V1: each "kv.{l}" in per-layer blocks,
each "conv.{m}"/"ssm.{m}" in per-slot states), so a *table* is keyed by
(buffer, item length, phase) and lists every item of that buffer:

    table ("kv", block_bytes, 0):  [kv+0*bb, kv+1*bb, ..., kv+(n-1)*bb]
    region kv[5*bb : 6*bb]  ->  index 5

Tables are prepared lazily on first use and then reused for every request,
locally and per remote agent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from transfer.handle import BufferInfo
from transfer.head_slices import SlicePair
from transfer.region_arrays import RegionArrays

TableKey = tuple[str, int, int]  # (buffer, item length, offset % length)
# {(local key, remote key): (local indices, remote indices)}, indices as int32.
PairGroups = dict[tuple[TableKey, TableKey], tuple[np.ndarray, np.ndarray]]


def table_entries(info: BufferInfo, key: TableKey) -> np.ndarray:
    """Nx3 (address, length, device id) rows tiling the buffer with `key`'s items."""
    _, length, phase = key
    count = (info.num_bytes - phase) // length
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = info.address + phase + np.arange(count, dtype=np.uint64) * length
    rows[:, 1] = length
    rows[:, 2] = info.device_id
    return rows


# prep_xfer_dlist for one peer: (entries, memory type of their buffer) -> handle.
Prepare = Callable[[np.ndarray, str], object]


class PreparedTables:
    """Prepared descriptor lists of one agent's view of one peer (or itself).

    `prepare(entries, mem_type)` wraps `prep_xfer_dlist` for that peer; a
    table is prepared with its buffer's own memory type (`BufferInfo.mem_type`:
    the peer's for remote tables, this worker's for local ones). Handles are
    created on first use of a key and kept until `release`.
    """

    def __init__(self, buffers: Mapping[str, BufferInfo], prepare: Prepare) -> None:
        self._buffers = dict(buffers)
        self._prepare = prepare
        self._handles: dict[TableKey, object] = {}
        self._lock = threading.Lock()

    def handle(self, key: TableKey) -> object:
        """The prepared list of `key`, prepared now if it is new; safe from
        several posting threads."""
        with self._lock:
            handle = self._handles.get(key)
            if handle is None:
                info = self._buffers[key[0]]
                handle = self._prepare(table_entries(info, key), info.mem_type)
                self._handles[key] = handle
            return handle

    def release(self) -> None:
        for handle in self._handles.values():
            release = getattr(handle, "release", None)
            if release is not None:
                release()
        self._handles.clear()


def group_arrays(src: RegionArrays, dst: RegionArrays) -> PairGroups:
    """Pair descriptors by position and group them by (local, remote) table.

    Returns {(dst key, src key): (dst indices, src indices)}; one NIXL request
    per group. Indices are int32 arrays, the form `make_prepped_xfer` takes
    without converting a Python list. The caller has checked both sides have
    equal lengths pairwise. A region's index in its table is `offset //
    length`. This runs once per pull over every descriptor (65,536 for a
    32,768-token prompt of a 32-layer V1 cache), so it is array operations.
    """
    return _group(
        src.names + dst.names,
        dst.codes + len(src.names),
        src.codes,
        dst.offsets,
        src.offsets,
        src.lengths,
    )


def group_slice_pairs(pairs: Sequence[SlicePair]) -> PairGroups:
    """`group_arrays` of every run of every pair, without a `Region` per run.

    A head-slice pull is hundreds to thousands of runs (64 MiB of a bench
    cache split in two is 256 runs of 128 KiB under V2, one per block, and
    1024 of 32 KiB under V1, one per layer and block) but a few pairs, each an
    arithmetic progression on both sides; the runs are expanded and grouped
    with array operations:

        pair (src_offset, dst_offset, run, num_runs, src_stride, dst_stride)
        run i:  src_offset + i * src_stride  ->  dst_offset + i * dst_stride
        table:  (buffer, run, offset % run), index offset // run

    Within a group, runs keep the order of `pairs` and of their steps.
    """
    if not pairs:
        return {}
    names = sorted({p.src_buffer for p in pairs} | {p.dst_buffer for p in pairs})
    code = {name: i for i, name in enumerate(names)}
    fields = np.array(
        [
            (code[p.dst_buffer], code[p.src_buffer], p.run, p.num_runs)
            + (p.dst_offset, p.src_offset, p.dst_stride, p.src_stride)
            for p in pairs
        ],
        dtype=np.int64,
    )
    counts = fields[:, 3]
    of_run = np.repeat(np.arange(len(pairs)), counts)
    step = np.arange(of_run.size) - np.repeat(np.cumsum(counts) - counts, counts)
    run = fields[of_run, 2]
    dst = fields[of_run, 4] + step * fields[of_run, 6]
    src = fields[of_run, 5] + step * fields[of_run, 7]
    return _group(names, fields[of_run, 0], fields[of_run, 1], dst, src, run)


def _group(
    names: Sequence[str],
    dst_codes: np.ndarray,
    src_codes: np.ndarray,
    dst: np.ndarray,
    src: np.ndarray,
    run: np.ndarray,
) -> PairGroups:
    """Runs `dst[i] <- src[i]` of `run[i]` bytes (buffers `names[..._codes[i]]`)
    grouped by (dst table, src table); within a group runs keep their order."""
    if not run.size:
        return {}
    keys = np.stack([dst_codes, src_codes, run, dst % run, src % run])
    order = np.lexsort(keys[::-1])  # stable: runs keep their order within a table pair
    ordered = keys[:, order]
    starts = np.flatnonzero(np.any(ordered[:, 1:] != ordered[:, :-1], axis=0)) + 1
    bounds = [0, *starts.tolist(), order.size]
    groups: PairGroups = {}
    for start, stop in zip(bounds, bounds[1:], strict=False):
        dst_code, src_code, length, dst_phase, src_phase = ordered[:, start].tolist()
        members = order[start:stop]
        key = (
            (names[dst_code], length, dst_phase),
            (names[src_code], length, src_phase),
        )
        groups[key] = (
            (dst[members] // length).astype(np.int32),
            (src[members] // length).astype(np.int32),
        )
    return groups
