"""GPU memory sizing by an instance's share of its GPU (`kvcache.gpu_share`), on a faked device.

A fake GPU hands each instance what the worker would measure (total, free
now, its own weights) and then charges it everything it holds: CUDA context
and weights first, then the cache it was sized for, then what comes after
the cache (workspaces, NCCL, the CUDA-graph pool), then a step's activations
with its largest transient peak. One, two and four instances per GPU must
all fit, at `memory_fraction` 1.0 too (so every byte must be counted),
whichever order they start in, and share evenly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from engine.cache_build import gpu_share, instance_overheads
from engine.worker_config import WorkerConfig
from kvcache.device_memory import DeviceMemory
from kvcache.errors import CacheSizingError
from kvcache.gpu_share import (
    GpuShare,
    InstanceOverheads,
    RuntimeReserve,
    TransientPeaks,
    attention_gather_bytes,
    sampling_bytes,
    ssd_scan_bytes,
    step_activation_bytes,
)
from kvcache.sizing import size_instance_cache
from kvcache.spec import CacheSpec
from models.embedded.writer import write_checkpoint
from models.hf_config import load_model_config
from models.layers.moe_experts import GATHER_BYTES

GIB = 1 << 30
MIB = 1 << 20
SPEC = CacheSpec(num_kv_heads=8, head_dim=128, attention_layers=tuple(range(32)), dtype="bfloat16")
BLOCK_BYTES = SPEC.num_attention_layers * 2 * 16 * 8 * 128 * 2
WEIGHTS = 16 * GIB
OVERHEADS = InstanceOverheads(
    activations=step_activation_bytes(
        num_tokens=8192,
        num_sequences=256,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        dtype_bytes=2,
    ),
    peaks=TransientPeaks(
        attention_gather=attention_gather_bytes(
            max_model_len=8192, num_kv_heads=8, head_dim=128, dtype_bytes=2
        ),
        sampling=sampling_bytes(num_rows=256, vocab_size=128256),
    ),
    reserve=RuntimeReserve(graph_pool=700 * MIB),
)


@dataclass
class FakeGpu:
    total: int
    used: int = 0
    peak: int = 0
    caches: list[int] = field(default_factory=list)

    def take(self, num_bytes: int) -> None:
        self.used += num_bytes
        self.peak = max(self.peak, self.used)

    def load(self, overheads: InstanceOverheads) -> DeviceMemory:
        """Create the context, load the weights; what the worker measures then."""
        self.take(overheads.reserve.cuda_context + WEIGHTS)
        return DeviceMemory(self.total, self.total - self.used, WEIGHTS)

    def serve(
        self, memory: DeviceMemory, share: float, fraction: float, o: InstanceOverheads
    ) -> None:
        """Size the cache from `memory`, take it, then all the instance allocates after it."""
        sizing = size_instance_cache(
            SPEC,
            block_size=16,
            model_len=8192,
            max_batch_size=256,
            gpu_share=GpuShare(memory, share, fraction, o),
        )
        self.take(sizing.total_bytes)
        self.take(o.reserve.after_cache)
        self.take(o.activations + o.peaks.largest)
        self.caches.append(sizing.total_bytes)


@pytest.mark.parametrize("fraction", [1.0, 0.9])
@pytest.mark.parametrize("instances", [1, 2, 4])
def test_instances_sharing_a_gpu_all_fit_and_share_evenly(instances: int, fraction: float) -> None:
    gpu = FakeGpu(total=141 * GIB)
    for _ in range(instances):  # one after another: each sees the others' caches
        gpu.serve(gpu.load(OVERHEADS), 1 / instances, fraction, OVERHEADS)
    assert gpu.peak <= fraction * gpu.total
    # Every instance gets the same cache, whether it started first or last.
    assert max(gpu.caches) - min(gpu.caches) < BLOCK_BYTES
    share = fraction * gpu.total / instances
    assert gpu.caches[0] > share - WEIGHTS - OVERHEADS.total - 2 * BLOCK_BYTES


def test_two_half_gpu_instances_starting_together_both_fit() -> None:
    """Both measure before either allocates its cache: the share bounds each."""
    gpu = FakeGpu(total=80 * GIB)
    memories = [gpu.load(OVERHEADS), gpu.load(OVERHEADS)]
    for memory in memories:
        gpu.serve(memory, 0.5, 1.0, OVERHEADS)
    assert gpu.peak <= gpu.total
    assert gpu.caches[0] == gpu.caches[1]


@pytest.mark.parametrize("peak", ["ssd_scan", "attention_gather", "moe_gather", "sampling"])
def test_each_transient_peak_is_left_free(peak: str) -> None:
    """Whichever peak is the largest, the cache leaves room for it: two
    half-GPU instances at fraction 1.0 still fit, and the cache shrinks by
    that peak."""
    huge = replace(OVERHEADS, peaks=replace(OVERHEADS.peaks, **{peak: 6 * GIB}))
    gpu = FakeGpu(total=80 * GIB)
    for _ in range(2):
        gpu.serve(gpu.load(huge), 0.5, 1.0, huge)
    assert gpu.peak <= gpu.total
    memory = DeviceMemory(80 * GIB, 60 * GIB, WEIGHTS)
    small = GpuShare(memory, 0.5, 1.0, OVERHEADS).budget()[0]
    large, source = GpuShare(memory, 0.5, 1.0, huge).budget()
    assert small - large == 6 * GIB - OVERHEADS.peaks.largest
    assert f"6144.0 MiB of {peak} peak" in source


def test_free_memory_bounds_a_share_that_others_already_took() -> None:
    # Another process holds most of the GPU: the share is not all there. The
    # context is in use already, so only what comes after the cache is kept free.
    memory = DeviceMemory(total=80 * GIB, free=30 * GIB, weights=WEIGHTS)
    budget, source = GpuShare(memory, 1.0, 0.9, OVERHEADS).budget()
    assert budget == 30 * GIB - OVERHEADS.after_cache
    assert "0.9 x 1 of 81920.0 MiB" in source and "CUDA-graph pool" in source


def test_a_share_too_small_for_its_weights_says_what_to_change() -> None:
    memory = DeviceMemory(total=24 * GIB, free=8 * GIB, weights=WEIGHTS)
    with pytest.raises(CacheSizingError, match="0.9 x 0.5 of 24576.0 MiB.*memory_fraction"):
        size_instance_cache(
            SPEC,
            block_size=16,
            model_len=8192,
            max_batch_size=256,
            gpu_share=GpuShare(memory, 0.5, 0.9, OVERHEADS),
        )


# --- the worker's reckoning, from a checkpoint's config --------------------------------


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sizing"), "nemotron_h", "tiny", seed=1)


def _config(checkpoint: Path, **overrides: object) -> WorkerConfig:
    fields = {"device": "cuda:0", "memory_fraction": 0.9, "max_tokens": None, **overrides}
    return WorkerConfig(checkpoint=str(checkpoint), **fields)  # type: ignore[arg-type]


def test_a_hybrid_instance_counts_every_peak_of_its_layers(hybrid_checkpoint: Path) -> None:
    model = load_model_config(hybrid_checkpoint)
    assert model.mamba is not None and model.moe is not None
    config = _config(hybrid_checkpoint, max_num_tokens=256, max_batch_size=8)
    peaks = instance_overheads(config, model).peaks
    mamba = model.mamba
    assert peaks.ssd_scan == ssd_scan_bytes(
        num_tokens=256,
        num_heads=mamba.num_heads,
        head_dim=mamba.head_dim,
        state_size=mamba.state_size,
        chunk_size=mamba.chunk_size,
    )
    assert peaks.attention_gather == attention_gather_bytes(
        max_model_len=model.max_position_embeddings,
        num_kv_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        dtype_bytes=4,  # the tiny checkpoint is float32
    )
    assert peaks.moe_gather == GATHER_BYTES
    assert peaks.sampling == 8 * model.vocab_size * 32


def test_peaks_grow_with_what_the_step_may_hold() -> None:
    scan = {
        n: ssd_scan_bytes(num_tokens=n, num_heads=8, head_dim=64, state_size=128, chunk_size=256)
        for n in (256, 512)
    }
    assert scan[512] == 2 * scan[256]
    # The float64 CDF over the vocabulary alone is 8 bytes an element.
    assert sampling_bytes(num_rows=4, vocab_size=1000) >= 4 * 1000 * 8


def test_reserve_holds_nccl_for_tensor_parallel_and_a_graph_pool(hybrid_checkpoint: Path) -> None:
    model = load_model_config(hybrid_checkpoint)
    one = instance_overheads(_config(hybrid_checkpoint), model).reserve
    two = instance_overheads(_config(hybrid_checkpoint, tensor_parallel_size=2), model).reserve
    assert one.nccl == 0 < two.nccl
    assert one.graph_pool > 0 and one.cuda_context > 0 and one.workspaces > 0


def test_the_worker_sizes_by_its_measured_weights_on_cuda_only(hybrid_checkpoint: Path) -> None:
    model = load_model_config(hybrid_checkpoint)
    assert gpu_share(_config(hybrid_checkpoint, device="cpu", max_tokens=64), model, None) is None
    with pytest.raises(ValueError, match="measured weights"):
        gpu_share(_config(hybrid_checkpoint), model, None)
