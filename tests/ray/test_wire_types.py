"""Every wire type survives a msgspec round trip; truncated or foreign bytes fail with a clear DecodeError."""

from __future__ import annotations

import msgspec
import pytest

from raystate import messages as m
from raystate.errors import InvalidRequest

SAMPLING = m.SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop_token_ids=[2, 9])
NEW = m.NewRequest(
    req_id="r-1",
    token_ids=m.ids_to_bytes([1, 258, 7, 2**31 - 1]),
    num_prompt_tokens=3,
    num_computed=0,
    replay_start=16,
    block_ids=[[1, 2], [0, 3]],
    num_scheduled=4,
    sampling=SAMPLING,
)
DELTA = m.RunningDelta("r-2", [[5], []], 1)
STEP = m.StepMessage(
    step_id=9, new_requests=[NEW], running=[DELTA], finished_ids=["r-0"], preempted_ids=["r-3"]
)
RESULT = m.StepResult(step_id=9, req_ids=["r-1", "r-2"], sampled=m.ids_to_bytes([-1, 42]), execute_ns=1234)
UPDATE = m.RequestUpdate("r-2", [42], True, "length", 16, 0)
ADD = m.AddRequest("r-4", m.ids_to_bytes([3, 4, 5]), SAMPLING)
BATCH = m.AddBatch("client-1", [ADD, m.AddRequest("r-5", m.ids_to_bytes([6]), m.SamplingParams())])
REJECTED = m.Rejected(1, "max_tokens", "<= 10", "11")
UPDATES = m.UpdateBatch([UPDATE, m.RequestUpdate("r-6", [], True, "abort", 0, 0)], error=None)

EVERY_TYPE = [SAMPLING, NEW, DELTA, STEP, RESULT, UPDATE, ADD, BATCH, REJECTED, UPDATES]


def test_every_wire_type_is_covered():
    covered = {type(x) for x in EVERY_TYPE}
    assert covered == set(m.WireType.__args__)


@pytest.mark.parametrize("value", EVERY_TYPE, ids=lambda v: type(v).__name__)
def test_round_trip(value):
    data = m.encode(value)
    assert msgspec.msgpack.decode(data, type=type(value)) == value


@pytest.mark.parametrize(
    ("decode", "value"),
    [
        (m.decode_step, STEP),
        (m.decode_result, RESULT),
        (m.decode_add_batch, BATCH),
        (m.decode_rejected, REJECTED),
        (m.decode_update_batch, UPDATES),
    ],
    ids=lambda x: getattr(x, "__name__", type(x).__name__),
)
def test_typed_decoders_round_trip_and_refuse_bad_bytes(decode, value):
    data = m.encode(value)
    assert decode(data) == value
    name = type(value).__name__
    with pytest.raises(msgspec.DecodeError, match=f"{name}: cannot decode {len(data) - 3} bytes"):
        decode(data[:-3])  # truncated
    with pytest.raises(msgspec.DecodeError, match=f"{name}: cannot decode"):
        decode(m.encode(m.SamplingParams()) if name != "SamplingParams" else b"\xc1")  # a foreign type
    with pytest.raises(msgspec.DecodeError, match=f"{name}: cannot decode"):
        decode(b"\xc1\xff not msgpack")


def test_token_ids_are_int32_little_endian():
    ids = [0, 1, 258, -1, 2**31 - 1]
    data = m.ids_to_bytes(ids)
    assert data[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert m.bytes_to_ids(data) == ids
    with pytest.raises(msgspec.DecodeError, match="not a multiple of 4"):
        m.bytes_to_ids(data[:-1])


def test_rejected_turns_into_the_invalid_request_it_reports():
    err = REJECTED.to_error()
    assert isinstance(err, InvalidRequest) and isinstance(err, ValueError)
    assert (err.field, err.limit) == ("max_tokens", "<= 10")
    assert str(err) == "max_tokens: must be <= 10, got 11"  # as the scheduler actor's own error read
