"""What a strict reply parser raises when a replica breaks its protocol."""

from __future__ import annotations


class MalformedResponse(ValueError):
    """A replica answered with a body that violates its protocol."""

    def __init__(self, replica: str, field_name: str, detail: str):
        super().__init__(f"malformed response from {replica}: field {field_name}: {detail}")
        self.replica, self.field_name = replica, field_name


def need(cond: bool, replica: str, field_name: str, detail: str) -> None:
    """Raise MalformedResponse naming ``field_name`` unless ``cond``."""
    if not cond:
        raise MalformedResponse(replica, field_name, detail)
