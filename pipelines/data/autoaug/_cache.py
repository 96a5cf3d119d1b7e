"""A per-process LRU cache of fetched samples, bounded by the bytes of their decoded pixels."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

Sample = tuple[torch.Tensor, dict]


class SampleCache:
    """Keeps the most recently used samples while their images total at most ``max_bytes``.

    A cached sample is shared between callers: never modify it in place. ``max_bytes = 0`` turns
    caching off. The cache is not pickled (each data-loader worker starts its own, empty), so it
    never changes what :meth:`get` returns, only how fast.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max(int(max_bytes), 0)
        self._entries: OrderedDict[int, Sample] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, index: int, fetch: Callable[[int], Sample]) -> Sample:
        """The sample ``index``: from the cache, or from ``fetch(index)`` (then cached if it fits)."""
        entry = self._entries.get(index)
        if entry is not None:
            self._entries.move_to_end(index)
            self.hits += 1
            return entry
        self.misses += 1
        sample = fetch(index)
        size = sample[0].numel() * sample[0].element_size()
        if 0 < size <= self.max_bytes:
            self._entries[index] = sample
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (old, _) = self._entries.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
        return sample

    def __getstate__(self) -> dict:
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_bytes"])
