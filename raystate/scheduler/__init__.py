"""raystate.scheduler: request queue, KV block pools, prefix cache with SWA bounded replay, routing.

Pure Python (plus numpy): never imports torch or triton. Only the Ray backend's modules import ray: the
scheduler actor (actor.py), its shard supervisor (supervisor.py) and the Ray dispatchers (ray_dispatch.py);
the step loop (driver.py) and the rest run without it, as the in-process engine and the tests use them.
"""

from raystate.messages import RequestUpdate
from raystate.scheduler.request import Request, RequestStatus
from raystate.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Request", "RequestStatus", "RequestUpdate", "Scheduler", "SchedulerStats"]
