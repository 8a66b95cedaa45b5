"""Shard choice: longest usable hit weighed against load, deterministic ties."""

import pytest

from raystate.scheduler.router import choose_shard


def test_least_loaded_without_hits():
    assert choose_shard([0, 0, 0], [3, 1, 2]) == 1


def test_a_long_hit_beats_a_little_load():
    assert choose_shard([0, 1024], [0, 2], load_penalty=128) == 1


def test_load_outweighs_a_short_hit():
    assert choose_shard([0, 100], [0, 2], load_penalty=128) == 0


def test_ties_go_to_lower_load_then_lower_index():
    assert choose_shard([0, 0, 0], [1, 1, 1]) == 0
    # Equal scores (256 - 128 * 2 == 0 - 128 * 0) with different loads: the lower load wins.
    assert choose_shard([256, 0], [2, 0], load_penalty=128) == 1


def test_candidates_restrict_the_choice():
    assert choose_shard([500, 0, 0], [0, 5, 1], candidates=[1, 2]) == 2
    with pytest.raises(ValueError, match="candidates"):
        choose_shard([0], [0], candidates=[])


def test_mismatched_lengths():
    with pytest.raises(ValueError, match="loads"):
        choose_shard([0, 0], [0])
