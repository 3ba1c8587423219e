"""Model runner: exact batch metadata, and chunked steps that reproduce
transformers' logits on a tiny Llama checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import model_runner
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import ScheduledSequence, Scheduler, SchedulerConfig
from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from kvcache.tensors import allocate_cache_tensors
from models.embedded.writer import write_checkpoint
from models.kernels import cpu_build
from models.loader import load_model
from tests.step_events import GatedEvent

BLOCK = 4


class Params:
    max_tokens = 16
    temperature = 0.0
    seed = None
    logprobs = None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runner") / "llama"
    return write_checkpoint(out, "llama", "tiny", seed=3, initializer_range=0.2)


def make_runner(checkpoint: Path, manager_name: str) -> tuple[ModelRunner, KVCacheManager, object]:
    model, config = load_model(checkpoint)
    manager = create_manager(manager_name, config.cache_spec(), 32, BLOCK)
    cache = allocate_cache_tensors(manager)
    runner = ModelRunner(model, cache.views(), manager, BLOCK, sampler=None)
    return runner, manager, model


def test_batch_metadata_for_a_decode_next_to_a_prefill_chunk(checkpoint: Path) -> None:
    runner, manager, _ = make_runner(checkpoint, "v1")
    dec = Request("dec", [5, 6, 7, 8, 9], Params(), output_token_ids=[11])
    dec.num_computed_tokens = 5
    pre = Request("pre", [20, 21, 22, 23, 24, 25, 26], Params())
    assert manager.allocate_slots("pre", 3)  # block 1 ...
    assert manager.allocate_slots("dec", 6)  # ... then blocks 2, 3
    assert manager.allocate_slots("pre", 6)  # ... and block 4
    seqs = [ScheduledSequence.of(dec, 1), ScheduledSequence.of(pre, 6)]
    batch = runner.build_batch(seqs)
    pre_table, dec_table = manager.block_table("pre"), manager.block_table("dec")
    assert batch.input_ids.tolist() == [11, 20, 21, 22, 23, 24, 25]
    assert batch.positions.tolist() == [5, 0, 1, 2, 3, 4, 5]
    assert batch.query_start_loc.tolist() == [0, 1, 7]
    assert batch.context_lens.tolist() == [5, 0]
    assert batch.seq_lens.tolist() == [6, 6]
    assert batch.block_tables.tolist() == [dec_table, pre_table]
    expected_slots = [dec_table[1] * BLOCK + 1] + [
        pre_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(6)
    ]
    assert batch.slot_mapping.tolist() == expected_slots
    # Only the decode samples: the prefill chunk stops short of its last token.
    assert batch.logits_indices.tolist() == [0]
    assert batch.mamba_slots is None


@pytest.mark.parametrize("manager_name", ["v1", "v2"])
def test_chunked_steps_reproduce_transformers_logits(checkpoint: Path, manager_name: str) -> None:
    from transformers import AutoModelForCausalLM

    runner, manager, model = make_runner(checkpoint, manager_name)
    prompts = [list(range(3, 14)), list(range(40, 45))]
    scheduler = Scheduler(SchedulerConfig(6, 8, 31 * BLOCK), manager)
    requests = [Request(f"r{i}", p, Params()) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add(r)
    last_logits: dict[str, torch.Tensor] = {}
    for _ in range(8):  # chunked prefill, then decodes of the greedy token
        out = scheduler.schedule()
        batch = runner.build_batch(out.sequences)
        with torch.inference_mode():
            hidden = model.forward(batch, runner.caches)
            logits = model.compute_logits(hidden[batch.logits_indices])
        scheduler.commit(out)
        for seq, row in zip([s for s in out.sequences if s.samples], logits, strict=True):
            last_logits[seq.request.request_id] = row
            seq.request.append_output(int(row.argmax()))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for r in requests:
        with torch.no_grad():
            ids = torch.tensor([r.all_token_ids[:-1]])
            expected = reference(ids).logits[0, -1]
        scale = expected.abs().max()
        torch.testing.assert_close(last_logits[r.request_id], expected, atol=1e-4 * scale, rtol=0)


def test_execute_samples_only_finished_chunks_with_logprobs(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    from engine.sampling import Sampler, SamplingParams

    model, config = load_model(checkpoint)
    manager = create_manager("v2", config.cache_spec(), 32, BLOCK)
    runner = ModelRunner(model, allocate_cache_tensors(manager).views(), manager, BLOCK, Sampler())
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
    done = Request("done", [9, 8, 7, 6, 5], params)
    partial = Request("partial", list(range(30, 42)), params)
    assert manager.allocate_slots("done", 5) and manager.allocate_slots("partial", 6)
    out = runner.execute([ScheduledSequence.of(done, 5), ScheduledSequence.of(partial, 6)])
    assert out.sampled[1] is None
    token = out.sampled[0]
    assert token is not None and token.top_logprobs is not None
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([done.prompt_token_ids])).logits[0, -1].log_softmax(-1)
    assert token.token_id == int(expected.argmax())
    assert token.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    assert [t for t, _ in token.top_logprobs] == expected.topk(2).indices.tolist()
    assert out.timings.forward_s > 0 and out.timings.build_s > 0


def test_greedy_steps_with_a_repetition_penalty_match_transformers_generate(
    checkpoint: Path,
) -> None:
    """The runner keeps each request's token history from step to step
    (`engine.token_history`); its greedy tokens under a repetition penalty
    are transformers' (which penalizes prompt and output tokens alike), and
    a finished request's history is dropped."""
    from transformers import AutoModelForCausalLM

    from engine.sampling import Sampler, SamplingParams

    model, config = load_model(checkpoint)
    manager = create_manager("v1", config.cache_spec(), 32, BLOCK)
    runner = ModelRunner(model, allocate_cache_tensors(manager).views(), manager, BLOCK, Sampler())
    new_tokens = 12
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, repetition_penalty=1.8)
    prompts = [[3, 4, 3, 4, 3, 4, 5], [40, 41, 42]]
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    plain = Request("plain", [3, 4, 3, 4, 3, 4, 5], SamplingParams(max_tokens=1, temperature=0.0))
    for r in [*requests, plain]:
        assert manager.allocate_slots(r.request_id, r.num_tokens)
    out = runner.execute([ScheduledSequence.of(r, r.num_tokens) for r in [*requests, plain]])
    for r, token in zip([*requests, plain], out.sampled, strict=True):
        assert token is not None
        r.num_computed_tokens = r.num_tokens
        r.append_output(token.token_id)
    assert set(runner.histories) == {"r0", "r1"}  # none for a request without penalties
    for _ in range(new_tokens - 1):
        for r in requests:
            assert manager.allocate_slots(r.request_id, r.num_tokens)
        out = runner.execute([ScheduledSequence.of(r, 1) for r in requests])
        for r, token in zip(requests, out.sampled, strict=True):
            assert token is not None
            r.num_computed_tokens = r.num_tokens
            r.append_output(token.token_id)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for r in requests:
        expected = reference.generate(
            torch.tensor([r.prompt_token_ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            repetition_penalty=1.8,
            pad_token_id=0,
        )[0, len(r.prompt_token_ids) :]
        assert r.output_token_ids == expected.tolist()
    runner.release("r0")
    assert set(runner.histories) == {"r1"}


class RecordedEvents:
    """Stands in for `record_event`: gated events, and the order in which
    they and the model's forwards happened."""

    def __init__(self, seconds: list[float] | None = None, done: bool = False) -> None:
        self.events: list[GatedEvent] = []
        self.log: list[str] = []
        self._seconds = seconds or []
        self._done = done

    def record(self, device: torch.device) -> GatedEvent:
        i = len(self.events)
        event = GatedEvent(self._seconds[i] if i < len(self._seconds) else 0.0)
        if self._done:
            event.complete()
        self.events.append(event)
        self.log.append(f"event {i}")
        return event

    def logging_forward(self, model: Any) -> None:
        forward = model.forward

        def logged(*args: Any) -> Any:
            out = forward(*args)
            self.log.append("forward")
            return out

        model.forward = logged


def test_a_step_that_samples_nothing_returns_before_its_written_event(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk short of its prompt's end: the step's `written` event
    comes after the forward that wrote its blocks, nobody waits for it (the
    host runs ahead of the device), and its span is not done, so no timing
    of it counts as the device's yet."""
    runner, manager, model = make_runner(checkpoint, "v1")
    recorded = RecordedEvents()
    monkeypatch.setattr(model_runner, "record_event", recorded.record)
    recorded.logging_forward(model)
    prompt = Request("pre", list(range(20, 32)), Params())
    assert manager.allocate_slots("pre", 8)
    out = runner.execute([ScheduledSequence.of(prompt, 8)])
    assert out.sampled == [None]
    assert out.written is recorded.events[-1]
    assert recorded.log.index("forward") < recorded.log.index(f"event {len(recorded.events) - 1}")
    assert not any(event.waited for event in recorded.events)
    assert out.timings.span.end is out.written and not out.timings.span.done()


def test_a_sampling_step_is_timed_by_its_events(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and sampling times come from the events around them (device
    times on a GPU), not from a host clock around a device-wide sync."""
    from engine.sampling import Sampler, SamplingParams

    model, config = load_model(checkpoint)
    manager = create_manager("v1", config.cache_spec(), 32, BLOCK)
    runner = ModelRunner(model, allocate_cache_tensors(manager).views(), manager, BLOCK, Sampler())
    # start, after the forward, after sampling, after the last write
    recorded = RecordedEvents(seconds=[0.0, 0.5, 0.25, 0.125], done=True)
    monkeypatch.setattr(model_runner, "record_event", recorded.record)
    prompt = Request("done", [9, 8, 7, 6, 5], SamplingParams(max_tokens=4, temperature=0.0))
    assert manager.allocate_slots("done", 5)
    out = runner.execute([ScheduledSequence.of(prompt, 5)])
    assert out.sampled[0] is not None and len(recorded.events) == 4
    assert out.timings.forward_s == 0.5 + 0.125 and out.timings.sample_s == 0.25
    assert out.written is recorded.events[-1] and out.timings.span.done()


def test_prepare_reaches_the_prompt_kernels_before_any_request(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up runs a prompt as well as a decode step: the C kernels are
    built on first use, and the first request must not wait for the prefill
    attention kernel's build."""
    asked: list[str] = []
    get = cpu_build.KernelFunction.get

    def recording_get(self: cpu_build.KernelFunction) -> object:
        asked.append(self.library)
        return get(self)

    monkeypatch.setattr(cpu_build.KernelFunction, "get", recording_get)
    runner, manager, _ = make_runner(checkpoint, "v1")
    free_before = manager.num_free_blocks
    runner.prepare(max_blocks_per_seq=4)
    assert {"decode_attention", "prefill_attention"} <= set(asked)
    assert manager.num_free_blocks == free_before  # the warm-up holds no block
