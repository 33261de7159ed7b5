"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens (n from the largest to the smallest allowed), over the prompt and the
outputs so far.

Each sequence keeps an index of its n-grams (n-gram -> the positions right after its first and
its latest occurrence), grown by the tokens appended since the last call: a proposal costs
O(new tokens) dict updates instead of a scan of the whole context every step. The latest
occurrence is the likelier continuation; when it lies too close to the end to give k tokens
(inside a run that repeats, where it is the previous period), the first one gives the longer
draft.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # n-gram -> the index of the token after its latest / first occurrence (every length).
        self._after: dict[tuple[int, ...], int] = {}
        self._first: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in `_after`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens continuing `tokens` ([] when no n-gram of its end occurred before)."""
        end = len(tokens)
        # Index every n-gram that ends before the last token: the last one's own n-grams are
        # what we look up, and must find an earlier occurrence, not themselves.
        after, first = self._after, self._first
        for stop in range(max(self._indexed, 1), end):  # the n-gram tokens[stop-n:stop]
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                gram = tuple(tokens[stop - n : stop])
                after[gram] = stop
                first.setdefault(gram, stop)
        self._indexed = max(self._indexed, end)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            gram = tuple(tokens[end - n :])
            start = after.get(gram)
            if start is not None:
                if end - start < k:
                    start = first[gram]
                return tokens[start : start + k]
        return []
