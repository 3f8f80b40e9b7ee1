"""Signed accusations: what one peer's audit found, in a form any other peer can check and re-run."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from meshd.errors import ErrorCode, MeshError
from meshd.identity import SIGNATURE_BYTES, Identity, public_key_matches, verify
from meshd.wire import audit_pb2 as pb

MAX_PROMPT = 256
MAX_TOKENS = 64


class BadAccusation(MeshError):
    """An accusation that does not parse, is not signed by its accuser, or carries no audit to re-run."""

    code = ErrorCode.BAD_REQUEST


def sign_accusation(identity: Identity, accused: str, model_id: str, compat_key: str, prompt: Sequence[int],
                    expected: Sequence[int], got: Sequence[int], at_ms: int) -> pb.SignedAccusation:
    record = pb.Accusation(accuser=identity.peer_id, accuser_key=identity.public_key, accused=accused,
                           model_id=model_id, compat_key=compat_key, prompt=list(prompt), expected=list(expected),
                           got=list(got), at_ms=at_ms)
    payload = record.SerializeToString(deterministic=True)
    return pb.SignedAccusation(accusation=payload, signature=identity.sign(payload))


def check_accusation(signed: pb.SignedAccusation) -> pb.Accusation:
    """The accusation, if its accuser signed it and it holds an audit that can be re-run."""
    record = pb.Accusation()
    try:
        record.ParseFromString(signed.accusation)
    except DecodeError:
        raise BadAccusation("the accusation does not parse") from None
    if not public_key_matches(record.accuser, record.accuser_key):
        raise BadAccusation("the accusation's key is not its accuser's")
    if len(signed.signature) != SIGNATURE_BYTES or not verify(record.accuser_key, signed.accusation,
                                                              signed.signature):
        raise BadAccusation(f"the accusation is not signed by {record.accuser[:12]}")
    if not record.accused or record.accused == record.accuser or not record.model_id or not record.compat_key:
        raise BadAccusation("the accusation names no other peer, or no model")
    if not 0 < len(record.prompt) <= MAX_PROMPT or not 0 < len(record.expected) <= MAX_TOKENS:
        raise BadAccusation("the accusation holds no audit to re-run")
    return record
