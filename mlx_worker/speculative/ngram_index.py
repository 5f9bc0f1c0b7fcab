"""Where each short n-gram of a token list last occurred: prompt lookup's index."""

from typing import Dict, List, Optional, Tuple


class NgramIndex:
    """n-grams of `min_n`..`max_n` tokens -> the position right after their latest
    occurrence, kept up to date as tokens are appended (each token indexed once)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.after: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this position are in

    def extend(self, tokens: List[int], end: int) -> None:
        """Index the n-grams that end before position `end`."""
        for i in range(self.indexed, end):
            for n, table in self.after.items():
                if i + 1 >= n:
                    table[tuple(tokens[i + 1 - n : i + 1])] = i + 1
        self.indexed = max(self.indexed, end)

    def match(self, tail: List[int], n: int) -> Optional[int]:
        """Where the latest indexed occurrence of `tail` (n tokens) is followed from."""
        return self.after[n].get(tuple(tail[-n:])) if len(tail) >= n else None

    def continuation(self, tokens: List[int], k: int) -> Tuple[int, List[int]]:
        """The tokens that followed the latest earlier occurrence of the longest n-gram
        `tokens` ends with (at most k), and that n; (0, []) when none occurred."""
        self.extend(tokens, len(tokens) - 1)  # every n-gram but the tail itself
        for n in range(self.max_n, self.min_n - 1, -1):
            j = self.match(tokens, n)
            if j is not None:
                return n, tokens[j : j + k]
        return 0, []
