"""A worker actor shows its start-up phases: the `raystate` logger's INFO goes to stderr (which Ray forwards
to the driver under the actor's prefix), one handler however often it is set up, none when a handler on the
way up already takes INFO; `startup_phases()` returns the seconds of each phase."""

from __future__ import annotations

import logging

import pytest
from ray_harness import engine_config

from raystate.worker import actor
from raystate.worker.actor import WorkerActor, show_info_on_stderr


@pytest.fixture
def clean_logging():
    """The `raystate` logger and the root logger as they were, after the test."""
    log, root = logging.getLogger("raystate"), logging.getLogger()
    saved = (log.level, list(log.handlers), log.propagate, root.level, list(root.handlers))
    log.handlers.clear()
    log.setLevel(logging.NOTSET)
    yield log
    log.setLevel(saved[0])
    log.handlers[:] = saved[1]
    log.propagate = saved[2]
    root.setLevel(saved[3])
    root.handlers[:] = saved[4]


def ours(log: logging.Logger) -> list[logging.Handler]:
    return [h for h in log.handlers if h.get_name() == actor._STDERR_HANDLER]


def test_info_goes_to_stderr_once(clean_logging, capsys, monkeypatch):
    log = clean_logging
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a Ray worker process: none, at WARNING
    root.setLevel(logging.WARNING)
    show_info_on_stderr()
    show_info_on_stderr()
    assert len(ours(log)) == 1 and log.getEffectiveLevel() == logging.INFO
    logging.getLogger("raystate.worker.worker").info("ready: weights %.2f s", 1.5)
    err = capsys.readouterr().err
    assert err.count("ready: weights 1.50 s") == 1, err


def test_a_configured_handler_is_used_instead(clean_logging, monkeypatch):
    log = clean_logging
    root = logging.getLogger()
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    monkeypatch.setattr(root, "handlers", [Collect(logging.INFO)])  # e.g. Ray's LoggingConfig
    show_info_on_stderr()
    assert ours(log) == []
    logging.getLogger("raystate.worker.actor").info("shard 0 start-up: weights 1.00 s")
    assert seen == ["shard 0 start-up: weights 1.00 s"]


def test_startup_phases(clean_logging, caplog):
    assert WorkerActor(engine_config(), 0, dry_run=True).startup_phases() == {}
    with caplog.at_level(logging.INFO, logger="raystate"):
        w = WorkerActor(engine_config(), 3)
    phases = w.startup_phases()
    assert list(phases)[:3] == ["weights", "buffers", "kv_cache"]
    assert all(isinstance(s, float) and s >= 0 for s in phases.values())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: ")]
    assert [line.split()[1] for line in lines] == list(phases)  # one line per phase, as it ends
    assert any("ready:" in r.getMessage() for r in caplog.records)
