"""DESIGN 3 steps 1-4 as the pure function `plan_replay` (W = P replay tokens)."""

import itertools

import pytest

from raystate.scheduler.replay import NO_HIT, max_hit_blocks, plan_replay

BS = 4
W = 8  # P: the sliding window's replay tokens


def test_no_hit():
    assert plan_replay(0, 40, BS, W) == NO_HIT
    assert plan_replay(0, 40, BS, 0) == NO_HIT


def test_hit_shorter_than_window_is_dropped():
    plan = plan_replay(1, 40, BS, W)  # h = 4 < W
    assert plan == NO_HIT
    assert plan.hit_tokens == 0 and plan.num_shared_blocks == 0


def test_hit_of_exactly_window_is_dropped():
    assert plan_replay(W // BS, 40, BS, W) == NO_HIT  # h = W = P


def test_hit_longer_than_window_replays_the_last_window():
    plan = plan_replay(5, 40, BS, W)  # h = 20
    assert plan.hit_tokens == 20
    assert plan.replay_start == plan.num_computed == 20 - W
    assert plan.num_shared_blocks == 5  # the replayed blocks stay shared too


def test_without_replay_tokens_a_hit_is_the_usual_prefix_hit():
    plan = plan_replay(2, 40, BS, 0)
    assert (plan.num_computed, plan.replay_start, plan.num_shared_blocks, plan.hit_tokens) == (8, 0, 2, 8)


@pytest.mark.parametrize("replay", [0, W])
def test_full_prompt_hit_still_computes_the_last_token(replay):
    # 16 tokens = 4 whole blocks, all cached: the hit keeps 3 blocks so the last token is computed.
    plan = plan_replay(4, 16, BS, replay)
    assert plan.hit_tokens == 12 < 16
    assert plan.num_shared_blocks == 3
    assert plan.num_computed == 12 - replay


def test_hit_is_whole_blocks_below_the_history_length():
    for num_tokens in range(1, 30):
        cap = max_hit_blocks(num_tokens, BS)
        assert cap * BS < num_tokens <= (cap + 1) * BS


@pytest.mark.parametrize("replay", [0, 4, W, 12])
def test_rules_hold_on_a_grid(replay):
    for blocks, num_tokens in itertools.product(range(12), range(1, 50)):
        plan = plan_replay(blocks, num_tokens, BS, replay)
        h = min(blocks, (num_tokens - 1) // BS) * BS
        assert plan.hit_tokens % BS == 0 and plan.hit_tokens < num_tokens
        if h == 0 or h <= replay:
            assert plan == NO_HIT
        else:
            assert plan.hit_tokens == h and plan.num_shared_blocks == h // BS
            assert plan.num_computed == h - replay
            assert plan.replay_start == (h - replay if replay else 0)
        assert plan.num_computed < num_tokens


def test_rejects_an_empty_history():
    with pytest.raises(ValueError, match="num_tokens"):
        plan_replay(0, 0, BS, W)
