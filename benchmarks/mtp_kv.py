"""The MTP attention layer's prompt K/V in 1P1D: send it with the cache, or
recompute it on the generation side?

    python -m benchmarks.mtp_kv                         # mini Nemotron-H + MTP, 1024 tokens
    python -m benchmarks.mtp_kv --size small --prompt-len 2048 --repeats 5

At prompt position p the MTP layers read the token at p + 1 and the target's
final hidden state at p. A generation worker that recomputed the MTP K/V of
the prompt would need those hidden states (one `hidden_size` vector per
prompt token) from the context worker, and would run the MTP over the whole
prompt before its first verify. Sending the K/V instead moves `2 x kv_heads
x head_dim` values per token and MTP attention layer, and costs the
generation side nothing.

The run prints, for one prompt of `--prompt-len` tokens on a random-weight
`disagg make-checkpoint --arch nemotron_h --mtp` checkpoint of `--size`:

- the bytes each way would move: the MTP K/V (what travels), the target's
  hidden states (what recompute needs), and the prompt's whole cache
  without MTP for scale;
- the time of that prompt's prefill on one engine with MTP drafting and one
  without, alternating, best of `--repeats` (the difference is the MTP's
  pass over the prompt, which recompute would move to the generation
  worker, ahead of its first token).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.instance import EngineInstance
from engine.request import Request
from engine.sampling import SamplingParams
from engine.speculation.config import SpeculativeConfig
from engine.worker_config import WorkerConfig
from models.config import ModelConfig
from models.embedded.writer import ensure_checkpoint
from models.hf_config import load_model_config
from models.loader import dtype_name, torch_dtype

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PromptBytes:
    """Bytes one prompt moves from the context to the generation worker."""

    cache: int  # the prompt's cache without MTP (K/V of every attention layer)
    mtp_kv: int  # the MTP attention layers' K/V: what sending adds
    hidden: int  # the target's hidden states: what recomputing would need


def prompt_bytes(config: ModelConfig, prompt_len: int) -> PromptBytes:
    """Block-rounded, as the cache moves whole blocks (hidden states would not be)."""
    blocks = -(-prompt_len // BLOCK_SIZE)
    plain = config.cache_spec()
    with_mtp = replace(config, use_mtp=True).cache_spec()
    per_layer = plain.kv_bytes_per_block_per_layer(BLOCK_SIZE) * blocks
    extra_layers = with_mtp.num_attention_layers - plain.num_attention_layers
    element = torch_dtype(config.dtype).itemsize
    return PromptBytes(
        cache=plain.num_attention_layers * per_layer,
        mtp_kv=extra_layers * per_layer,
        hidden=prompt_len * config.hidden_size * element,
    )


def prefill_seconds(instance: EngineInstance, prompt: list[int], name: str) -> float:
    """One prompt through its context prefill (first token and, with MTP, first drafts)."""
    request = Request(name, list(prompt), SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    instance.core.add(request)
    while instance.core.has_work():
        instance.core.step()
    elapsed = time.perf_counter() - start
    instance.core.free_cache(name)  # the pull that never comes
    return elapsed


def build(checkpoint: Path, mtp: bool, prompt_len: int) -> EngineInstance:
    config = WorkerConfig(
        checkpoint=str(checkpoint),
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_tokens=4 * prompt_len,
        max_num_tokens=prompt_len,
        max_batch_size=1,
        speculative=SpeculativeConfig(method="mtp") if mtp else None,
    )
    return EngineInstance.build(config, "context", "mtp-kv" if mtp else "plain")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="mini", choices=("tiny", "mini", "small"))
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoint goes")
    args = parser.parse_args(argv)
    root = args.workdir or Path(tempfile.gettempdir()) / "disagg-mtp-kv"
    checkpoint = ensure_checkpoint(
        root / f"{args.size}-nemotron-h-mtp", "nemotron_h", args.size, mtp=True
    )
    config = load_model_config(checkpoint)
    sizes = prompt_bytes(config, args.prompt_len)
    rng = random.Random(0)
    prompt = [rng.randrange(10, config.vocab_size) for _ in range(args.prompt_len)]
    engines = {
        "mtp": build(checkpoint, True, args.prompt_len),
        "plain": build(checkpoint, False, args.prompt_len),
    }
    best = {name: float("inf") for name in engines}
    for repeat in range(args.repeats):
        for name, instance in engines.items():
            best[name] = min(best[name], prefill_seconds(instance, prompt, f"{name}-{repeat}"))
    mtp_pass = best["mtp"] - best["plain"]
    print(
        f"checkpoint: {checkpoint} ({args.size}, {dtype_name(config.dtype)}), "
        f"prompt {args.prompt_len} tokens, best of {args.repeats}"
    )
    print(f"{'prompt cache without MTP':<40}{sizes.cache:>14,} B")
    print(
        f"{'send: MTP K/V':<40}{sizes.mtp_kv:>14,} B  (+{sizes.mtp_kv / sizes.cache:.1%} of the cache)"
    )
    print(
        f"{'recompute: target hidden states':<40}{sizes.hidden:>14,} B  "
        f"({sizes.hidden / sizes.mtp_kv:.2f}x the MTP K/V)"
    )
    print(f"{'prefill without MTP':<40}{best['plain'] * 1e3:>12.1f} ms")
    print(f"{'prefill with MTP':<40}{best['mtp'] * 1e3:>12.1f} ms")
    print(
        f"{'MTP pass over the prompt':<40}{mtp_pass * 1e3:>12.1f} ms  "
        f"({mtp_pass / best['plain']:.1%} of the prefill; recompute would add it "
        "on the generation side before the first verify)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
