"""The engine loop's per-step timeline: what each step cost on the compute
thread, what ran in the gap after it, and which periods count as long."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from engine.loop import EngineLoop
from engine.step_timeline import StepRecord, long_steps
from tests.scripted_core import ScriptedCore


def _sleep() -> None:
    time.sleep(0.02)  # wall time, next to no CPU


def _spin() -> None:
    start = time.thread_time()
    while time.thread_time() - start < 0.02:  # 20 ms of this thread's CPU
        pass


async def _steps(loop: EngineLoop, count: int) -> None:
    while loop.stats.steps < count:
        await asyncio.sleep(0.005)


async def test_records_split_wall_from_cpu_and_count_calls_and_idle_time() -> None:
    core = ScriptedCore([_sleep, _spin])
    loop = EngineLoop(core)  # type: ignore[arg-type]
    loop.start()
    await asyncio.wait_for(_steps(loop, 2), 10.0)
    await asyncio.sleep(0.05)  # the loop idles: nothing to step
    core.actions.append(_sleep)
    loop.call_between_steps(lambda: None)  # applied in the gap before the third step
    await asyncio.wait_for(_steps(loop, 3), 10.0)
    await loop.stop()
    slept, spun = loop.timeline.records  # the third step's gap is still open
    assert slept.step_s >= 0.02 and slept.step_cpu_s < slept.step_s / 2
    assert spun.step_cpu_s >= 0.02 and spun.process_cpu_s >= spun.step_cpu_s
    assert slept.idle_s == 0.0 and slept.num_calls == 0
    assert spun.idle_s >= 0.05 and spun.num_calls == 1
    assert slept.period_s >= slept.step_s + slept.gap_s
    assert slept.num_seqs == slept.num_tokens == 1


def _record(period_s: float, **fields: float) -> StepRecord:
    base = StepRecord(
        start=0.0,
        handoff_s=0.0,
        step_s=period_s,
        step_cpu_s=period_s,
        process_cpu_s=period_s,
        wake_s=0.0,
        gap_s=0.0,
        idle_s=0.0,
        num_seqs=2,
        num_tokens=2,
        num_calls=0,
        calls_s=0.0,
        gc_s=0.0,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def test_long_steps_are_decode_periods_over_the_factor_times_the_median() -> None:
    records = [_record(0.030)] * 5 + [
        _record(0.050),  # 1.67x the median: long
        _record(0.040),  # 1.33x: not long
        _record(0.300, num_tokens=258),  # a prefill chunk: not a decode step
        _record(0.030, idle_s=1.0),  # the loop then waited for work: nobody waited on it
    ]
    found = long_steps(records, factor=1.5)
    assert found.num_steps == 7
    assert found.median_period_s == 0.030
    assert [r.period_s for r in found.long] == [0.050]
    assert long_steps(records, decode_only=False).num_steps == 8
    assert long_steps([]).num_long == 0
