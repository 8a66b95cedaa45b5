"""The GPU benchmarks' CPU smoke modes, through `raystate bench` as a user would run them: the scripts
import each other and the package, and their reports hold the figures BENCHMARKS.md quotes."""

from __future__ import annotations

import json

import pytest

from raystate.cli import main

pytestmark = pytest.mark.slow  # whole benchmark runs, interpreted kernels: most of two minutes


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)


def test_prefix_bench_smoke(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert main(["bench", "--suite", "prefix", "--smoke", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TTFT p50 replay / cache everything" in text
    report = json.loads(out.read_text())
    modes = {m["mode"]: m for m in report["modes"]}
    assert set(modes) == {"recompute", "cache everything", "bounded replay", "replay, unshared"}
    # The burst shares one replay (the first request rebuilds the window, the rest borrow it).
    assert modes["bounded replay"]["shared_replay_tokens"] > 0
    assert modes["replay, unshared"]["shared_replay_tokens"] == 0
    # tiny: 2 of 4 layers are full attention, so replay keeps half the KV per cached token.
    assert (
        modes["cache everything"]["kv_bytes_per_cached_token"]
        == 2 * modes["bounded replay"]["kv_bytes_per_cached_token"]
    )
    assert modes["bounded replay"]["prefixes_in_pool"] > modes["cache everything"]["prefixes_in_pool"]
    assert modes["recompute"]["prefix_hit_tokens"] == 0 < modes["bounded replay"]["prefix_hit_tokens"]


def test_throughput_bench_smoke(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["bench", "--suite", "throughput", "--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    off, on = report["runs"]
    assert not off["profile"] and on["profile"]
    assert off["output_tokens"] == on["output_tokens"] > 0
    assert set(report["breakdown"]["all steps"]["ms_per_step"]) >= {"schedule", "forward", "update"}
