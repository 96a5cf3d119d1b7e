"""Keys said twice in one JSON object, which a JSON parser (orjson, Python's json) silently reduces to
the last.

orjson cannot report a repeated key, so :func:`repeated_key` first compares two counts, and parses a
second time (Python's json, with a hook that sees every key) only where they disagree:

* the key ends in the bytes: every ``:`` directly after a ``"`` (numpy). Every key ends this way
  unless whitespace stands between its closing quote and its colon, so with no colon after
  whitespace this is at least the number of keys written in the file (a string value that starts
  with ``:`` or holds an escaped ``\\":`` only adds to it);
* the keys of the parsed objects: the top level, the objects it holds directly, the entries of its
  lists (images, annotations, categories), and the objects below those that are the value of a key
  which the bytes show holding an object (``"segmentation": {``, a crowd region's RLE), with all
  the objects they hold; an object in a list below the top level is not counted. Only the values
  under those key names are looked at, not every value of a million annotations.

The parsed objects hold at most as many keys as the file writes, and fewer exactly when a key is
repeated; the first count is at least the keys written and the second at most the keys parsed. So
when the two counts are equal no key is repeated; when they differ (a repeated key, but also
whitespace before a colon, a deeper object, a string starting with ``:``), the second parse decides.
"""

from __future__ import annotations

import json
from itertools import chain, repeat

import numpy as np

_QUOTE, _COLON, _BRACE = ord('"'), ord(":"), ord("{")
_SPACE = np.array([ord(c) for c in " \t\r\n"], dtype=np.uint8)
_SLICE = 1 << 22  # bytes scanned at a time


class RepeatedKey(ValueError):
    """A key written twice in one object: ``key``, and ``where`` (which object, in words)."""

    def __init__(self, key: str, where: str):
        super().__init__(f"{where} has the key {key!r} twice")
        self.key, self.where = key, where


def repeated_key(data: bytes, parsed) -> RepeatedKey | None:
    """The first repeated key of the JSON document ``data`` (already parsed into ``parsed``, which the
    counts are checked against), or None if every object writes each key once."""
    written, holders = _scan(data)
    if written is not None and written == _keys_parsed_at_most(parsed, _key_names(data, holders)):
        return None
    try:
        json.loads(data, object_pairs_hook=_unique_pairs)
    except RepeatedKey as err:
        return err
    except RecursionError:  # nested deeper than Python's json goes (orjson goes to 1024): no COCO file
        pass
    return None


def _scan(data: bytes) -> tuple[int | None, list[int]]:
    """``(key ends, colons before an object)``: how many ``:`` directly follow a ``"`` (None if some ``:``
    follows whitespace, as a key's may), and where the ``:`` stands before each ``{`` that is a key's
    value. In slices, so that no temporary array is as large as the file."""
    raw = np.frombuffer(data, dtype=np.uint8)
    ends, holders = 0, []
    for start in range(0, len(raw), _SLICE):
        part = raw[max(start - 1, 0):start + _SLICE]  # with the byte before the slice
        before = part[np.flatnonzero(part[1:] == _COLON)]
        if np.isin(before, _SPACE).any():
            return None, []
        ends += int(np.count_nonzero(before == _QUOTE))
        at = np.flatnonzero(raw[start:start + _SLICE] == _BRACE) + (start - 1)
        at = at[at >= 0]
        for _ in range(64):  # back over the whitespace before each "{" (indentation), a step at a time
            spaces = np.isin(raw[at], _SPACE)
            if not spaces.any():
                break
            at = at - spaces
            at = at[at >= 0]
        holders += at[raw[at] == _COLON].tolist()
    return ends, holders


def _key_names(data: bytes, colons: list[int]) -> set[str]:
    """The names of the keys that end at ``colons`` (``"name":``); a name with an escaped quote comes
    out wrong, which only makes the count inconclusive."""
    names = set()
    for colon in colons:
        end = data.rfind(b'"', 0, colon)
        start = data.rfind(b'"', 0, end)
        if start >= 0:
            names.add(data[start + 1:end].decode("utf-8", "replace"))
    return names


def _keys_parsed_at_most(parsed, holders: set[str]) -> int:
    """Keys of the top-level object, of the objects it holds and those its lists hold (images,
    annotations, categories), and of the objects below those under the key names ``holders`` (with
    all the objects they hold); objects in lists below the top level are not counted."""
    if type(parsed) is not dict:
        return 0
    objects = [v for v in parsed.values() if type(v) is dict]
    for value in parsed.values():
        if type(value) is list:
            objects += [v for v in value if type(v) is dict]
    total = len(parsed) + sum(map(len, objects))
    nested = []
    for key in holders:
        nested += [v for v in map(dict.get, objects, repeat(key)) if type(v) is dict]
    while nested:
        total += sum(map(len, nested))
        nested = [v for v in chain.from_iterable(map(dict.values, nested)) if type(v) is dict]
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
