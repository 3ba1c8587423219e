"""An `EngineCore` stand-in for engine-loop tests: one decode token per
scripted action, the action running where the loop runs the model."""

from __future__ import annotations

from collections.abc import Callable

from engine.core import StepPlan, StepResult
from engine.model_runner import RunnerOutput
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput


class ScriptedCore:
    """Has work while actions are queued; each step pops and runs one in
    `execute` (the compute thread, under `EngineLoop`)."""

    def __init__(self, actions: list[Callable[[], None]]) -> None:
        self.actions = actions
        self.request = Request("scripted", [1], SamplingParams())

    def has_work(self) -> bool:
        return bool(self.actions)

    def schedule(self) -> StepPlan:
        sched = SchedulerOutput([ScheduledSequence.of(self.request, 1)])
        return StepPlan(sched, StepResult(num_tokens=1, num_seqs=1))

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.actions.pop(0)()
        return RunnerOutput(sampled=[None])

    def update(self, plan: StepPlan, runner_out: RunnerOutput) -> StepResult:
        return plan.result
