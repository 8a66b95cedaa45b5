"""`raystate serve` reports a failed start in one line: the cause at the end of a Ray error's message."""

from __future__ import annotations

from raystate.cli import _reason


def test_the_last_line_of_a_multi_line_error_is_its_reason():
    # The shape of a Ray actor's creation error: its header and the worker's traceback, the cause last.
    error = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::WorkerActor.__init__()\n"
        '  File "kernels/_common.py", line 25, in env_choice\n'
        "ValueError: RAYSTATE_PDL='yes': expected one of 0, 1 (unset: 1)\n"
    )
    assert _reason(error) == "ValueError: RAYSTATE_PDL='yes': expected one of 0, 1 (unset: 1)"


def test_an_error_without_a_message_is_named_by_its_type():
    assert _reason(TimeoutError()) == "TimeoutError"
    assert _reason(OSError("  \n ")) == "OSError"
