"""Drafters: what a row's next tokens probably are, from text already seen.

`PromptLookup` (method ngram) matches the longest n-gram the request's tokens end with
against its own prompt and output, and proposes what followed it (vLLM's n-gram
speculation; most of an edited file is in the prompt). `SuffixLookup` (method suffix)
also looks in the outputs of recent requests (agents repeat themselves across turns),
with longer n-grams, and takes the longer match.
"""

from collections import OrderedDict
from typing import List

from .ngram_index import NgramIndex


class PromptLookup:
    min_n, max_n = 2, 4

    def propose(self, seq, k: int) -> List[int]:
        if seq.draft_index is None:
            seq.draft_index = NgramIndex(self.min_n, self.max_n)
        return seq.draft_index.continuation(seq.tokens, k)[1]

    def finished(self, seq) -> None:
        seq.draft_index = None


class SuffixLookup(PromptLookup):
    min_n, max_n = 2, 8
    keep_outputs = 256  # recent requests' outputs searched

    def __init__(self):
        self.outputs: "OrderedDict[int, List[int]]" = OrderedDict()  # request arrival -> its output
        self.index = NgramIndex(self.min_n, self.max_n)  # over the outputs, each ending in a separator
        self.tokens: List[int] = []  # the outputs, one after another

    def propose(self, seq, k: int) -> List[int]:
        if seq.draft_index is None:
            seq.draft_index = NgramIndex(self.min_n, self.max_n)
        n, own = seq.draft_index.continuation(seq.tokens, k)
        for m in range(self.max_n, max(n, self.min_n - 1), -1):  # a longer match among recent outputs wins
            j = self.index.match(seq.tokens, m)
            if j is not None and j < len(self.tokens):
                other = self.tokens[j : j + k]
                return other[: other.index(SEPARATOR)] if SEPARATOR in other else other
        return own

    def finished(self, seq) -> None:
        seq.draft_index = None
        output = seq.output_ids
        if len(output) < self.min_n:
            return
        if len(self.outputs) >= self.keep_outputs:
            self._rebuild()
        self.outputs[seq.arrival] = output
        self.tokens += output + [SEPARATOR]
        self.index.extend(self.tokens, len(self.tokens))

    def _rebuild(self) -> None:
        """Drop the older half of the outputs (the index cannot forget one by one)."""
        while len(self.outputs) > self.keep_outputs // 2:
            self.outputs.popitem(last=False)
        self.index = NgramIndex(self.min_n, self.max_n)
        self.tokens = [t for out in self.outputs.values() for t in out + [SEPARATOR]]
        self.index.extend(self.tokens, len(self.tokens))


SEPARATOR = -1  # between outputs: no n-gram spans two


class ModelDrafter:
    """Methods draft and mtp: a model drafts inside the step (draft_model.py, mtp_drafter.py), so every
    row has k drafts; the budget picks rows and k as for any method, and the worker fills
    these placeholders in with the model's tokens."""

    def propose(self, seq, k: int) -> List[int]:
        return [0] * k

    def finished(self, seq) -> None:
        pass


def make_drafter(method: str):
    return {"ngram": PromptLookup, "suffix": SuffixLookup, "draft": ModelDrafter, "mtp": ModelDrafter}[method]()
