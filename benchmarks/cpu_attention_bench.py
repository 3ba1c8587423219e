"""CPU decode-attention microbenchmark: the C kernel against torch's gather + SDPA.

    python -m benchmarks.cpu_attention_bench [--rounds 7] [--batches 8 32 64]

For every (dtype, batch, keys per sequence) it times one decode-attention call
of a Llama-style layer (8 query heads, 2 kv heads, head dim 64, block 16; the
sequences hold between 3/4 of the keys and all of them) three ways:

- torch: the paged cache gathered with `index_select`, then a masked
  `scaled_dot_product_attention`, as `models.layers.attention` runs it when
  the kernel cannot serve a call;
- C 1t: the kernel on one thread;
- C 2t: the kernel on two threads (wall time).

The machine is shared, so single-thread figures are CPU time of the calling
thread (`time.thread_time`), and every figure is the minimum over `--rounds`
rounds that alternate the paths, so a neighbour's burst hits one round of one
path, not a whole column.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.kernels import cpu_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16
# Many kernel calls per sample: one call is tens of microseconds, below the
# resolution of thread_time on some kernels.
_CALLS_PER_SAMPLE = 20


@dataclass(frozen=True)
class Shape:
    dtype: torch.dtype
    batch: int
    keys: int


@dataclass(frozen=True)
class DecodeInputs:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor


def make_inputs(shape: Shape, seed: int = 0) -> DecodeInputs:
    """A V1 pool (head-outer blocks, as `kvcache.pool_layout` lays them out)
    with shuffled blocks; sequence lengths in [3/4 keys, keys]."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(shape.keys * 3 // 4, shape.keys + 1, (shape.batch,), generator=gen)
    width = -(-shape.keys // BLOCK)
    num_blocks = shape.batch * width + 1
    pool = torch.randn(num_blocks, KV_HEADS, 2, BLOCK, HEAD_DIM, generator=gen).to(shape.dtype)
    pool = pool.permute(0, 2, 3, 1, 4)  # indexed [block, 2, offset, head, dim]
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    q = torch.randn(shape.batch, HEADS, HEAD_DIM, generator=gen).to(shape.dtype)
    tables = ids[: shape.batch * width].view(shape.batch, width)
    return DecodeInputs(q, pool[:, 0], pool[:, 1], tables, lens)


def torch_decode(inputs: DecodeInputs, scale: float) -> torch.Tensor:
    """Gather + masked SDPA, the torch path of `models.layers.attention.decode_attention`."""
    batch, heads, dim = inputs.q.shape
    width = inputs.tables.shape[1]
    span = width * BLOCK
    blocks = inputs.tables.reshape(-1)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # head-outer blocks -> [B, kv, span, d]
        picked = cache.transpose(1, 2).index_select(0, blocks)
        picked = picked.view(batch, width, KV_HEADS, BLOCK, dim).transpose(1, 2)
        return picked.reshape(batch, KV_HEADS, span, dim)

    grouped = inputs.q.view(batch, KV_HEADS, heads // KV_HEADS, dim)
    visible = torch.arange(span)[None, :] < inputs.seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        grouped,
        gather(inputs.key_cache),
        gather(inputs.value_cache),
        attn_mask=visible[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, heads, dim)


def kernel_decode(inputs: DecodeInputs, scale: float) -> torch.Tensor:
    return cpu_attention.paged_attention_decode_cpu(
        inputs.q, inputs.key_cache, inputs.value_cache, inputs.tables, inputs.seq_lens, scale
    )


def _sample(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    """Microseconds per call on `clock`, over `_CALLS_PER_SAMPLE` calls."""
    begin = clock()
    for _ in range(_CALLS_PER_SAMPLE):
        fn()
    return (clock() - begin) / _CALLS_PER_SAMPLE * 1e6


def measure(shape: Shape, rounds: int) -> dict[str, float]:
    """Min-of-rounds microseconds per call for each path."""
    inputs = make_inputs(shape)
    scale = HEAD_DIM**-0.5
    torch.testing.assert_close(
        kernel_decode(inputs, scale).float(),
        torch_decode(inputs, scale).float(),
        atol=1e-2,
        rtol=1e-2,
    )
    runs: dict[str, tuple[Callable[[], object], Callable[[], float], int]] = {
        "torch": (lambda: torch_decode(inputs, scale), time.thread_time, 1),
        "C 1t": (lambda: kernel_decode(inputs, scale), time.thread_time, 1),
        "C 2t": (lambda: kernel_decode(inputs, scale), time.perf_counter, 2),
    }
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, (fn, clock, threads) in runs.items():
            # 1 << 62: never split; 0: always split over `threads`.
            cpu_attention._PARALLEL_WORK = 1 << 62 if threads == 1 else 0
            torch.set_num_threads(threads)
            best[name] = min(best[name], _sample(fn, clock))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--keys", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    probe = make_inputs(Shape(torch.float32, 1, 16))
    if not cpu_attention.supported(probe.q, probe.key_cache, probe.value_cache):
        raise SystemExit("the C kernel is not available here (no C compiler?)")
    threshold, threads = cpu_attention._PARALLEL_WORK, torch.get_num_threads()
    print(f"heads {HEADS}, kv heads {KV_HEADS}, head dim {HEAD_DIM}, block {BLOCK}")
    print("us per call, min of rounds; torch and C 1t: thread CPU time, C 2t: wall time")
    print(f"{'dtype':>9} {'batch':>5} {'keys':>5} {'torch':>9} {'C 1t':>9} {'C 2t':>9} {'x':>6}")
    try:
        for dtype_name in args.dtypes:
            for batch in args.batches:
                for keys in args.keys:
                    best = measure(Shape(getattr(torch, dtype_name), batch, keys), args.rounds)
                    print(
                        f"{dtype_name:>9} {batch:>5} {keys:>5} {best['torch']:>9.1f} "
                        f"{best['C 1t']:>9.1f} {best['C 2t']:>9.1f} "
                        f"{best['torch'] / best['C 1t']:>6.2f}",
                        flush=True,
                    )
    finally:
        cpu_attention._PARALLEL_WORK = threshold
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
