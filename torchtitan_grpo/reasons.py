"""How an exception reads in a log line or a recorded reason.

Some exceptions carry no message: asyncio's and aiohttp's timeouts, a bare
``ConnectionResetError()``, a cancelled future. ``f"... failed: {e}"`` then
logs "failed: " and nothing after it; these name the exception's type
instead. Shared by ``fleet``, ``server`` and ``weight_sync`` (none owns it).
"""

from __future__ import annotations


def reason(e: BaseException) -> str:
    """``str(e)``, or the exception's type name when that is empty."""
    return str(e) or type(e).__name__


def typed_reason(e: BaseException) -> str:
    """``"TypeName: message"``, or ``"TypeName"`` alone when the message is empty."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
