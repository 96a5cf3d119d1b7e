"""How tracking words what it reports: what is wrong with a store (:func:`reason`) and counts (:func:`plural`)."""

from __future__ import annotations

import re

from ..errors import first_line

NO_ANSWER = "no answer within"
"""How the message of a store call still running at its deadline begins (``store.NoAnswer``)."""


def reason(err: BaseException) -> str:
    """What is wrong with the store, in a few words, for a warning: ``err`` is what a store call raised."""
    text = str(err)
    if text.startswith(NO_ANSWER):
        return f"not answering ({err})"
    if "database is locked" in text or "database table is locked" in text:
        return "locked"
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return "not answering (timed out)"
    if re.search(r"refused|Max retries exceeded|Failed to establish|Name or service not known|NameResolution"
                 r"|unable to open database|Connection (aborted|reset)", text, re.IGNORECASE):
        return "unreachable"
    first = first_line(err, 200)
    return f"failing ({type(err).__name__}: {first})" if first else f"failing ({type(err).__name__})"


def plural(n: int, word: str) -> str:
    """``"1 tag"``, ``"3 tags"``."""
    return f"{n} {word}" + ("" if n == 1 else "s")
