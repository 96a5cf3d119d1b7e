"""Keys said twice in one JSON object, which a JSON parser (orjson, Python's json) silently reduces to
the last.

orjson cannot report a repeated key, so :func:`repeated_key` first compares two counts, and parses a
second time (Python's json, with a hook that sees every key) only where they disagree:

* the key ends in the bytes: every ``:`` directly after a ``"`` (numpy). Every key ends this way
  unless whitespace stands between its closing quote and its colon, so with no colon after
  whitespace this is at least the number of keys written in the file (a string value that starts
  with ``:`` or holds an escaped ``\\":`` only adds to it);
* the keys of the parsed objects: the top level, the objects it holds directly, the entries of its
  lists (images, annotations, categories) and the objects nested in those; an object deeper than
  that, or inside a list below the top level, is not counted.

The parsed objects hold at most as many keys as the file writes, and fewer exactly when a key is
repeated; the first count is at least the keys written and the second at most the keys parsed. So
when the two counts are equal no key is repeated; when they differ (a repeated key, but also
whitespace before a colon, a deeper object, a string starting with ``:``), the second parse decides.
"""

from __future__ import annotations

import json
from itertools import chain

import numpy as np

_QUOTE, _COLON, _BRACE = ord('"'), ord(":"), ord("{")
_SPACE = np.array([ord(c) for c in " \t\r\n"], dtype=np.uint8)


class RepeatedKey(ValueError):
    """A key written twice in one object: ``key``, and ``where`` (which object, in words)."""

    def __init__(self, key: str, where: str):
        super().__init__(f"{where} has the key {key!r} twice")
        self.key, self.where = key, where


def repeated_key(data: bytes, parsed) -> RepeatedKey | None:
    """The first repeated key of the JSON document ``data`` (already parsed into ``parsed``, which the
    counts are checked against), or None if every object writes each key once."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if _keys_written_at_least(raw) == _keys_parsed_at_most(parsed, int(np.count_nonzero(raw == _BRACE))):
        return None
    try:
        json.loads(data, object_pairs_hook=_unique_pairs)
    except RepeatedKey as err:
        return err
    return None


def _keys_written_at_least(raw: np.ndarray) -> int | None:
    """``"`` directly before ``:`` in ``raw``; None if some ``:`` follows whitespace (a key may end so)."""
    before = raw[np.flatnonzero(raw[1:] == _COLON)]  # the byte before each colon
    if np.isin(before, _SPACE).any():
        return None
    return int(np.count_nonzero(before == _QUOTE))


def _keys_parsed_at_most(parsed, braces: int) -> int:
    """Keys of the top-level object, of the objects it holds and those its lists hold, and of objects
    nested in those (objects in lists below the top level are not counted). ``braces``: the ``{`` in
    the file, at least its objects: where the objects counted first are as many, there is none below
    them to look for (the values of a million annotations are not looked through)."""
    if type(parsed) is not dict:
        return 0
    objects = [v for v in parsed.values() if type(v) is dict]
    for value in parsed.values():
        if type(value) is list:
            objects += [v for v in value if type(v) is dict]
    total = len(parsed)
    if 1 + len(objects) >= braces:
        return total + sum(map(len, objects))
    while objects:
        total += sum(map(len, objects))
        objects = [v for v in chain.from_iterable(map(dict.values, objects)) if type(v) is dict]
    return total


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    seen = set()
    for key, _ in pairs:
        if key in seen:
            break
        seen.add(key)
    if isinstance(result.get("id"), int) and not isinstance(result["id"], bool):
        kind = "annotation" if "image_id" in result else "image" if "file_name" in result else \
            "category" if "name" in result else "object with"
        where = f"{kind} id {result['id']}"
    elif {"images", "annotations", "categories"} & result.keys():
        where = "the top-level object"
    else:
        where = "an object with the keys " + ", ".join(map(repr, result))[:120]
    raise RepeatedKey(key, where)
