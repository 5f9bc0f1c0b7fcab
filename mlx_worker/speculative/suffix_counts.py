"""How often each token followed each short context: suffix decoding's tree, flattened.

A suffix tree of depth D over a token stream holds, at the node of every context of up
to D tokens, how often each token came next (Arctic Inference's suffix decoding, vLLM's
`suffix` method). Here the nodes are keyed by a hash of their context (contexts of
`min_n`..`max_n` tokens), so a token costs `max_n - min_n + 1` dict updates and a context
seen once costs one int; counts can be taken out again, so recent requests' outputs
form a sliding window.

A draft follows the tree greedily: from the longest context the text ends with, the
most frequent next token, then from the context that ends with it, and so on while the
path's probability (the product of each step's count over its node's total) stays at
least MIN_PROB. Its score, the sum of those probabilities, is the number of its
tokens expected to be accepted, which is how two trees' drafts are compared.
"""

from typing import Dict, List, Optional, Tuple, Union

MIN_PROB = 0.1  # Arctic's min_token_prob

Node = Union[int, Dict[int, int]]  # the one token seen after a context, or each one's count


class SuffixCounts:
    def __init__(self, min_n: int = 2, max_n: int = 8):
        self.min_n, self.max_n = min_n, max_n
        self.next: Dict[int, Node] = {}
        self.indexed = 0  # tokens before this position are counted (for `extend`)

    def _keys(self, tokens: List[int], end: int) -> List[int]:
        """Keys of the contexts of min_n..max_n tokens that end before `end`, shortest first."""
        keys, h = [], 0
        for n in range(1, min(self.max_n, end) + 1):
            h = hash((h, tokens[end - n]))
            if n >= self.min_n:
                keys.append(h)
        return keys

    def add(self, tokens: List[int], start: int, end: int, sign: int = 1) -> None:
        """Count (sign -1: uncount) the tokens at positions start..end-1 after their contexts."""
        table = self.next
        for i in range(max(start, self.min_n), end):
            t = tokens[i]
            for key in self._keys(tokens, i):
                node = table.get(key)
                if node is None:
                    if sign > 0:
                        table[key] = t
                elif type(node) is int:
                    if sign > 0:
                        table[key] = {node: 1, t: 1} if node != t else {t: 2}
                    elif node == t:
                        del table[key]
                else:
                    c = node.get(t, 0) + sign
                    if c > 0:
                        node[t] = c
                    else:
                        node.pop(t, None)
                        if not node:
                            del table[key]

    def extend(self, tokens: List[int]) -> None:
        """Count the tokens appended since the last call."""
        self.add(tokens, self.indexed, len(tokens))
        self.indexed = len(tokens)

    def draft(self, tokens: List[int], k: int, stop: Optional[int] = None) -> Tuple[float, List[int]]:
        """(score, up to k tokens that likely follow `tokens`); (0.0, []) when no context
        of at least min_n tokens was seen. `stop`: a token never drafted (a separator)."""
        context, out, prob, score = list(tokens[-self.max_n:]), [], 1.0, 0.0
        while len(out) < k:
            node = None
            for key in reversed(self._keys(context, len(context))):
                node = self.next.get(key)
                if node is not None:
                    break
            if node is None:
                break
            if type(node) is int:
                t, p = node, 1.0
            else:
                t, c = max(node.items(), key=lambda tc: tc[1])
                p = c / sum(node.values())
            prob *= p
            if t == stop or prob < MIN_PROB:
                break
            out.append(t)
            score += prob
            context = (context + [t])[-self.max_n:]
        return score, out
