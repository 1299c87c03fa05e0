"""The bearer-token rule that REST and gRPC share.

A write carries ``Authorization: Bearer <token>`` (an HTTP header, or gRPC metadata
``authorization``). The scheme name is case-insensitive (RFC 7235, section 2.1:
``bearer``, ``BEARER`` and ``Bearer`` are the same scheme) and is separated from the
token by one or more spaces; the token itself is compared exactly, in constant time.
"""

from __future__ import annotations

import hmac

__all__ = ["bearer_token", "token_matches"]


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization`` value ``Bearer <token>``, or None when the value
    is missing, names another scheme, or carries no token (or more than one word)."""
    if not header:
        return None
    scheme, sep, rest = header.strip(" ").partition(" ")
    token = rest.strip(" ")
    if not sep or scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def token_matches(header: str | None, want: str | None) -> bool:
    """Whether ``header`` (an ``Authorization`` value) carries the token ``want``; False
    when no token is configured."""
    if not want:
        return False
    got = bearer_token(header)
    return got is not None and hmac.compare_digest(got.encode(), want.encode())
