"""CPU prompt attention: the tiled C prefill kernel against the other paths.

    python -m benchmarks.prefill_attention_bench [--lens 256 1024 2048 4096]

For one causal prompt of each length, already in a paged cache (SmolLM2's
attention shape by default: 9 query heads, 3 kv heads, head dim 64, block
16, fp32), it times one layer's attention three ways, on torch's threads
(wall time; the minimum over `--rounds` rounds that alternate the paths):

- tiled: `cpu_attention.paged_prefill_attention_if_supported`, what
  `models.layers.attention` runs up to `_TILED_MAX_LEN` keys;
- per token: every query token as a row of the decode kernel, the path for
  head dims the tiled kernel does not serve (up to 1,024 keys);
- SDPA: torch's causal `scaled_dot_product_attention` over the prompt's own
  K/V, the path past the C kernels' limits.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.batch import ChunkRows
from models.kernels import cpu_attention

_CALLS_PER_SAMPLE = 3


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    for _ in range(_CALLS_PER_SAMPLE):
        fn()
    return (time.perf_counter() - start) / _CALLS_PER_SAMPLE * 1e3


def measure(length: int, heads: int, kv_heads: int, dim: int, block: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks = -(-length // block)
    key_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen)
    value_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen)
    q = torch.randn(length, heads, dim, generator=gen)
    table = torch.arange(blocks).view(1, -1)
    chunks = ChunkRows(
        torch.tensor([0]), torch.tensor([length]), table, torch.tensor([length]), length**2
    )
    out = torch.empty_like(q)
    scale = dim**-0.5
    token_tables = table.expand(length, -1).contiguous()
    positions = torch.arange(1, length + 1)
    keys = key_cache.view(-1, kv_heads, dim)[:length]
    values = value_cache.view(-1, kv_heads, dim)[:length]

    def tiled() -> None:
        assert cpu_attention.paged_prefill_attention_if_supported(
            q, key_cache, value_cache, chunks, out, scale
        )

    def per_token() -> None:
        cpu_attention.paged_attention_decode_cpu(
            q, key_cache, value_cache, token_tables, positions, scale
        )

    def sdpa() -> None:
        q_h, k_h, v_h = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
        F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=True, scale=scale, enable_gqa=True)

    paths = {"tiled": tiled, "per token": per_token, "SDPA": sdpa}
    for fn in paths.values():
        fn()  # warm up
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(rounds):
        for name, fn in paths.items():
            best[name] = min(best[name], _time(fn))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, fp32, "
        f"{torch.get_num_threads()} threads; ms per layer (min of {args.rounds} rounds)"
    )
    print(f"{'tokens':>8} {'tiled':>9} {'per token':>10} {'SDPA':>9}")
    for length in args.lens:
        t = measure(length, args.heads, args.kv_heads, args.head_dim, args.block, args.rounds)
        print(f"{length:8d} {t['tiled']:9.3f} {t['per token']:10.3f} {t['SDPA']:9.3f}")


if __name__ == "__main__":
    main()
