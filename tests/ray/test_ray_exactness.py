"""backend="ray" gives token for token what the in-process backend gives (issue 4, test 1).

With one shard the scheduler sees the same batches as in-process, so even bounded replay (an
approximation by design) matches, prefix hits and replay starts included. With two shards routing decides
which requests share a cache, so bounded replay is off: every prefix hit is then exact.
"""

from __future__ import annotations

import pytest
import ray
from ray_harness import TEST_OPTIONS, greedy, inprocess_outputs, llm_kwargs, shared_prefix_prompts

from raystate import LLM, InvalidRequest

MAX_TOKENS = 8


@pytest.mark.parametrize(
    ("num_shards", "dispatch", "replay", "pipelined"),
    [
        (1, "compiled", True, False),
        (2, "compiled", False, False),
        (2, "compiled", False, True),
        (2, "actor", False, False),
    ],
    ids=[
        "1-shard-compiled-replay",
        "2-shards-compiled",
        "2-shards-compiled-pipelined",
        "2-shards-actor-calls",
    ],
)
def test_ray_backend_equals_inprocess(local_ray, num_shards, dispatch, replay, pipelined):
    """`pipelined`: the graph runs each worker's `execute_behind` (on the CPU every step is done at launch,
    so none is held: the holding itself is tested in tests/scheduler/test_pipelined_dispatch.py)."""
    prompts = shared_prefix_prompts(seed=num_shards, num=10, prefix_len=70)
    calls = [prompts, prompts[:4]]  # the second call finds the first one's prefixes cached
    want = inprocess_outputs(calls, MAX_TOKENS, swa_bounded_replay=replay)
    llm = LLM(
        backend="ray",
        num_shards=num_shards,
        ray_options={**TEST_OPTIONS, "dispatch": dispatch, "pipeline_steps": pipelined},
        **llm_kwargs(replay),
    )
    try:
        assert llm.cluster.deployment.dispatch == dispatch
        got = [
            llm.generate(prompt_token_ids=p, sampling_params=greedy(MAX_TOKENS), use_tqdm=False)
            for p in calls
        ]
        with pytest.raises(InvalidRequest, match="prompt_token_ids"):
            llm.generate(prompt_token_ids=[[1, 2, 3], [1, 999]], sampling_params=greedy(4), use_tqdm=False)
        counts = ray.get(llm.cluster.scheduler.status.remote())
        # Compiled graphs plan decode steps on top of the one in flight (async scheduling); actor calls don't.
        assert (counts["lookahead_steps"] > 0) == (dispatch == "compiled")
        assert counts["pipelined"] == pipelined and counts["flushes"] == 0
    finally:
        llm.shutdown()
    for got_call, want_call in zip(got, want, strict=True):
        assert [o.token_ids for o in got_call] == [o.token_ids for o in want_call]
        assert [o.text for o in got_call] == [o.text for o in want_call]
        assert all(o.finish_reason == "length" for o in got_call)
        if num_shards == 1:
            assert [(o.num_cached_tokens, o.replay_start) for o in got_call] == [
                (o.num_cached_tokens, o.replay_start) for o in want_call
            ]
    assert all(o.num_cached_tokens > 0 for o in got[1])
    if replay:
        assert all(o.replay_start > 0 for o in got[1])  # bounded replay ran on the worker actor
