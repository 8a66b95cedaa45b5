"""raystate.scheduler: request queue, KV block pools, prefix cache with SWA bounded replay, routing.

Pure Python (plus numpy): never imports torch or triton; only scheduler/actor.py imports ray.
"""

from raystate.messages import RequestUpdate
from raystate.scheduler.request import Request, RequestStatus
from raystate.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Request", "RequestStatus", "RequestUpdate", "Scheduler", "SchedulerStats"]
