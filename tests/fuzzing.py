"""Hypothesis strategies for fuzzing the parsers that read network and client bytes.

``messages(descriptor)`` draws protobuf messages of any schema with every field possibly set to an
edge value (huge integers, NaN and infinite floats, odd strings, empty and long bytes, nested
messages to a bounded depth, each oneof branch), so a parser is driven past "does not parse" into
the checks behind it. ``mutated`` then flips, cuts or splices the serialized bytes. The number of
examples per test is ``MESHD_FUZZ_EXAMPLES`` (a short run by default; see docs/development.md).
"""

from __future__ import annotations

import os
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("MESHD_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                              HealthCheck.data_too_large])

_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, 2, -1, 7, 8, 16, 1024, 2**16, 2**31 - 1, 2**32 - 1, 2**63 - 1, lo, hi) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, min(hi, 64)) if lo <= 64 else st.nothing(),
                     st.integers(lo, hi))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INTS:
        return _integers(*_INTS[t])
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e30, float("nan"), float("inf"), float("-inf")]),
                         st.floats(allow_nan=True, allow_infinity=True, width=32 if t == FieldDescriptor.TYPE_FLOAT
                                   else 64))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(["", "x", "model", "float32", "F32", "a" * 300, "\x00", "../etc"]),
                         st.text(max_size=40))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.sampled_from([b"", b"\x00" * 32, b"\xff" * 64]), st.binary(max_size=80))
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), _integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field type {t}")


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int) -> Message:
    msg = GetMessageClass(descriptor)()
    oneof_fields = {f.name for o in descriptor.oneofs for f in o.fields}
    chosen = {draw(st.sampled_from([f.name for f in o.fields])) for o in descriptor.oneofs if o.fields}
    for field in descriptor.fields:
        if field.name in oneof_fields and field.name not in chosen:
            continue
        if field.name not in oneof_fields and not draw(st.booleans()):
            continue
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                entry = field.message_type.fields_by_name
                key_field, value_field = entry["key"], entry["value"]
                for _ in range(draw(st.integers(0, 3))):
                    key = draw(_scalar(key_field))
                    target = getattr(msg, field.name)
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        if depth > 0:
                            target[key].CopyFrom(draw(_message(value_field.message_type, depth - 1)))
                    else:
                        target[key] = draw(_scalar(value_field))
                continue
            if depth <= 0:
                continue
            if repeated:
                for _ in range(draw(st.integers(0, 3))):
                    getattr(msg, field.name).add().CopyFrom(draw(_message(field.message_type, depth - 1)))
            else:
                getattr(msg, field.name).CopyFrom(draw(_message(field.message_type, depth - 1)))
        elif repeated:
            getattr(msg, field.name).extend(draw(st.lists(_scalar(field), max_size=5)))
        else:
            setattr(msg, field.name, draw(_scalar(field)))
    return msg


def messages(message_class: type[Message], depth: int = 4) -> st.SearchStrategy[Message]:
    """Messages of ``message_class``'s schema, fields drawn from edge values and anything else."""
    return _message(message_class.DESCRIPTOR, depth)


@st.composite
def mutated(draw: st.DrawFn, raw: st.SearchStrategy[bytes]) -> bytes:
    """``raw`` bytes, sometimes cut short, with bytes flipped, or with random bytes spliced in."""
    data = bytearray(draw(raw))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["flip", "cut", "splice"]))
        if action == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif action == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)):]
        elif action == "splice":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(max_size=16))
    return bytes(data)


def wire_bytes(message_class: type[Message], depth: int = 4) -> st.SearchStrategy[bytes]:
    """Serialized messages of the schema, mutated or not, and plain random bytes."""
    serialized = messages(message_class, depth).map(lambda m: m.SerializeToString())
    return st.one_of(serialized, mutated(serialized), st.binary(max_size=200))
