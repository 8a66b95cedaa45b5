"""Type checks of the flat option dataclasses users fill from Python (`EngineArgs`, `LaunchOptions`).

The CLI's flags and the Serve app's pydantic args check types before these classes are built; the
Python API (`LLM(...)`, `Cluster.start(...)`) has no schema in front of it. Without these checks a
value of the wrong type (`max_num_seqs="8"`) fails as a bare TypeError inside a range check, and an
unknown name as dataclasses' TypeError; here both are `InvalidRequest`s naming the field. Standard
library only.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from typing import Any

from raystate.errors import InvalidRequest


def field_value_type(annotation: Any) -> tuple[Any, bool]:
    """(the type of a set value, whether None is allowed) of a field annotation such as `int | None`."""
    args = typing.get_args(annotation)
    set_types = [t for t in args if t is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return (set_types[0] if len(set_types) == 1 else annotation), type(None) in args
    return annotation, False


def is_of_type(value: Any, want: Any) -> bool:
    """bool is only bool; int any integer but a bool; float any real number but a bool; a generic
    container its origin (dict[str, str]: a dict); anything else isinstance."""
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    origin = typing.get_origin(want)
    if origin is not None:
        return isinstance(value, origin) if isinstance(origin, type) else True
    return isinstance(value, want) if isinstance(want, type) else True


def check_field_types(instance: Any) -> None:
    """Every field of the dataclass `instance` holds a value of its annotated type (see is_of_type);
    raises InvalidRequest naming the first that does not."""
    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        want, optional = field_value_type(hints[f.name])
        if value is None and optional:
            continue
        if not is_of_type(value, want):
            name = getattr(want, "__name__", str(want))
            raise InvalidRequest(f.name, f"of type {name}{' or None' if optional else ''}", value)


def check_names(cls: type, kwargs: dict[str, Any], what: str) -> None:
    """Every keyword names a field of the dataclass `cls`; raises InvalidRequest naming the first that
    does not, with the list of `what` (e.g. "an engine knob") it could be."""
    names = {f.name for f in dataclasses.fields(cls)}
    for name in kwargs:
        if name not in names:
            raise InvalidRequest(name, f"{what} ({', '.join(sorted(names))})", name)
