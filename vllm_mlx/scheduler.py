"""The public path ``vllm_mlx.scheduler``: a face of ``vllm_mlx.core.sched.scheduler``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.core.sched.scheduler``."""

# face: the code lives in vllm_mlx/core/sched/scheduler.py; edit it there.
from vllm_mlx.core.sched.scheduler import (  # noqa: F401
    ModelRunnerOutput,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    TokenLogprobs,
)

__all__ = [
    "ModelRunnerOutput",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "TokenLogprobs",
]
