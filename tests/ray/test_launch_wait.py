"""`launch.wait_started`: a Serve replica that finds a deployment being started by another process
(`raystate serve` starts the backend while Serve starts) waits for it instead of starting a second one."""

from __future__ import annotations

import threading
import time

from ray.util.placement_group import placement_group, remove_placement_group
from ray_harness import TEST_OPTIONS, engine_config

from raystate import launch
from raystate.cluster import Cluster


def test_no_start_in_progress_returns_at_once(local_ray):
    t0 = time.monotonic()
    assert not launch.starting("nobody") and not launch.wait_started("nobody", timeout_s=30)
    assert time.monotonic() - t0 < 5


def test_a_start_in_progress_is_waited_for_until_it_fails_or_runs(local_ray):
    # A placement group of the deployment's name without a scheduler: a start in progress.
    pg = placement_group([{"CPU": 0.01}], name="raystate-pending")
    assert launch.starting("pending")
    assert not launch.wait_started("pending", timeout_s=0.5)  # still starting when the wait ends
    remove_placement_group(pg)  # the start failed: the waiter returns at once
    assert not launch.starting("pending") and not launch.wait_started("pending", timeout_s=30)

    # A real start on another thread: the waiter returns True once it runs, and connects to it.
    started: list[Cluster] = []
    thread = threading.Thread(
        target=lambda: started.append(Cluster.start(engine_config(), name="waited", **TEST_OPTIONS))
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not launch.starting("waited") and not launch.exists("waited") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launch.wait_started("waited", timeout_s=120)
        connected = Cluster.connect("waited")
        connected.close()
    finally:
        thread.join()
        for cluster in started:
            cluster.stop()
