"""Fault isolation: one bad request must never take the engine down.

What the engine promises when a step raises (issue #14):

- Per-request failures are found before compute (`ModelRunner.prepare`) and fail that request
  alone; the rest of the step runs.
- A batched forward or sampling that raises is rolled back: nothing of the step counts (no
  computed tokens advanced, no tokens appended, and the blocks it was to write leave the prefix
  cache), every running request is preempted for recompute, and the step's requests become
  suspects. The scheduler then runs each suspect alone (`Scheduler.schedule`, isolation mode):
  one that samples a token is cleared; one whose solo step raises is the culprit and fails
  with finish_reason "error". A step with a single request is a solo step from the start.
- A fault that is not a request's: an exception that looks fatal for the device (a CUDA error,
  a device-side assert, NCCL; not an out-of-memory), any failure of a tensor-parallel step
  (`RankFailure`: the ranks' collectives are out of step, or a rank is gone), or
  `max_consecutive_step_failures` solo steps in a row that all raise (each a different request,
  as each failure ends its request), is re-raised, and AsyncEngine stops the engine.
"""

from __future__ import annotations

import logging

import torch

from kubeinfer.runtime.engine.model_runner import ModelRunner
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sched_output import SchedulerOutput
from kubeinfer.runtime.engine.scheduler import Scheduler
from kubeinfer.runtime.engine.tp_workers import RankFailure

logger = logging.getLogger(__name__)

_FATAL_MARKERS = ("CUDA error", "device-side assert", "NCCL")


def is_fatal(error: BaseException) -> bool:
    """True when the device (or the process) cannot be trusted after `error`."""
    if not isinstance(error, Exception) or isinstance(error, RankFailure):
        return True  # KeyboardInterrupt, SystemExit; a tensor-parallel rank out of step
    if isinstance(error, torch.cuda.OutOfMemoryError):  # a smaller step may well fit
        return False
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _FATAL_MARKERS)


def failure_message(error: BaseException) -> str:
    """One short line for the client: the error's type and first line, never a traceback."""
    lines = str(error).strip().splitlines()
    detail = lines[0][:200] if lines else ""
    return f"request failed in the engine: {type(error).__name__}: {detail}".rstrip(": ")


class StepFailures:
    """The engine's answer to a step that raised; counts failed solo steps in a row."""

    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, max_consecutive_failures: int
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_consecutive_failures = max_consecutive_failures
        self.num_consecutive_failures = 0

    def on_success(self) -> None:
        self.num_consecutive_failures = 0

    def on_failure(self, step: SchedulerOutput, error: Exception) -> list[Request]:
        """Roll the failed step back; the requests to fail now (the culprit of a solo step),
        or none (a batch: its requests are suspects now). Re-raises `error` when the fault is
        not a request's."""
        step_ids = [s.request.request_id for s in step.scheduled]
        if is_fatal(error):
            raise error
        if len(step.scheduled) == 1:
            self.num_consecutive_failures += 1
            if self.num_consecutive_failures >= self.max_consecutive_failures:
                logger.error(
                    "%d solo steps in a row failed: the fault is not a request's",
                    self.num_consecutive_failures,
                )
                raise error
            request = step.scheduled[0].request
            logger.warning("request %s failed alone in a step", request.request_id, exc_info=error)
            self.scheduler.forget_step_blocks(request)
            self.runner.roll_back(step_ids, [])
            return [request]
        logger.warning(
            "a step of %d requests failed; rolling it back, then running each alone",
            len(step_ids),
            exc_info=error,
        )
        preempted = self.scheduler.roll_back(step)
        self.runner.roll_back(step_ids, [r.request_id for r in preempted])
        return []
