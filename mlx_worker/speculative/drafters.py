"""Drafters: what a row's next tokens probably are, from text already seen.

`PromptLookup` (method ngram) matches the longest n-gram the request's tokens end with
against its own prompt and output, and proposes what followed it (vLLM's n-gram
speculation; most of an edited file is in the prompt). `SuffixLookup` (method suffix)
counts what followed every context, in the request's tokens and in the outputs of recent
requests (agents repeat themselves across turns), and proposes the likeliest path, as
long as it stays likely (Arctic Inference's suffix decoding).
"""

from collections import deque
from typing import Deque, List

from .ngram_index import NgramIndex
from .suffix_counts import SuffixCounts


class PromptLookup:
    min_n, max_n = 2, 4

    def propose(self, seq, k: int) -> List[int]:
        if seq.draft_index is None:
            seq.draft_index = NgramIndex(self.min_n, self.max_n)
        return seq.draft_index.continuation(seq.tokens, k)[1]

    def finished(self, seq) -> None:
        seq.draft_index = None


class SuffixLookup:
    """Suffix decoding: the request's own tokens and the last `keep_outputs` requests'
    outputs, each counted as a suffix tree (suffix_counts.py); the draft of the higher
    score wins."""

    min_n, max_n = 2, 8
    keep_outputs = 256

    def __init__(self):
        self.outputs: Deque[List[int]] = deque()  # the outputs counted, oldest first
        self.recent = SuffixCounts(self.min_n, self.max_n)

    def propose(self, seq, k: int) -> List[int]:
        if seq.draft_index is None:
            seq.draft_index = SuffixCounts(self.min_n, self.max_n)
        seq.draft_index.extend(seq.tokens)
        own = seq.draft_index.draft(seq.tokens, k)
        other = self.recent.draft(seq.tokens, k, stop=SEPARATOR)
        return (other if other[0] > own[0] else own)[1]

    def finished(self, seq) -> None:
        seq.draft_index = None
        output = seq.output_ids + [SEPARATOR]  # counted too: where outputs end, drafts stop
        if len(output) <= self.min_n:
            return
        if len(self.outputs) >= self.keep_outputs:
            old = self.outputs.popleft()
            self.recent.add(old, 0, len(old), sign=-1)
        self.outputs.append(output)
        self.recent.add(output, 0, len(output))


SEPARATOR = -1  # ends each output counted: a draft stops there


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
