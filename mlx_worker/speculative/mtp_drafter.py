"""Method mtp: the checkpoint's own MTP head (mtp_head.py) drafts, run by the engine on
the target's final hidden states.

The head's KV lives in a pool of its own on the target's pages, as a draft model's does
(draft_model.py): its entry at position i comes from token i + 1 and the target's hidden
state at i, so it trails the target by one position. Every target forward is mirrored
(`mirror`): a forward over positions [s, s + L) gives hidden states there and tokens
s .. s + L - 1, which fill the head's positions s - 1 .. s + L - 2, the first one only
if the sequence still carries its hidden state at s - 1 (`Sequence.hidden`: the last
positions of its last forward; none after a prefix hit, whose pages hold it already).
A verify row's k drafts come from k one-token forwards of the head, each on the head's
own output for the next (its entries at those positions are rewritten by the verify
forward's mirror with the target's states). On a sharded replica every rank holds the
whole head (the final hidden states, the embedding and the output head are whole on
every rank, tensor or pipeline) and the drafts are rank 0's.
"""

from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..distributed.ranks import rank0s
from ..memory.kv_pool import KVPool
from ..memory.model_caches import probe_caches
from ..memory.step_kv import StepKV
from ..models.output_head import split_output_head
from .mtp_qwen import text_model


class _HeadAsModel(nn.Module):
    """The head with a model's call, so `probe_caches` reads its cache layout."""

    def __init__(self, head, embed):
        super().__init__()
        self.head, self.embed, self.layers = head, embed, head.layers

    def __call__(self, x, cache=None):
        e = self.embed(x)
        return self.head(e, mx.zeros_like(e), cache or [None] * len(self.layers))


def mtp_head_specs(head, model) -> list:
    """The head's attention layers' KV shapes (for the pool's size)."""
    return probe_caches(_HeadAsModel(head, text_model(model)[0].embed_tokens)).kv


class MTPDrafter:
    needs_hidden = True

    def __init__(self, model, head, num_pages: int, page_size: int, head_groups: bool, group=None):
        self.group = group  # a sharded replica's ranks: each holds the whole head; drafts are rank 0's
        split = split_output_head(model)
        if split is None:
            raise ValueError("speculative method 'mtp' needs the model's output head apart from its body")
        self.head, self.output_head = head, split[1]
        self.weights = head  # what its KV is computed with (the SSD tier's key)
        body, args = text_model(model)
        self.embed = body.embed_tokens
        dtype = next(v.dtype for _, v in tree_flatten(head.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        self.no_state = mx.zeros((args.hidden_size,), dtype)  # a row that carries no hidden state (never expected)
        self.tree = probe_caches(_HeadAsModel(head, self.embed))
        self.pool = KVPool(self.tree.kv, self.tree.kv_dtype, num_pages, page_size)
        self.kv = StepKV(self.pool, self.tree, head_groups=head_groups)
        self.num_forwards = 0

    def mirror(self, inputs: mx.array, seqs: Sequence, offsets: Sequence[int], L: int,
               hidden: Optional[mx.array] = None, verify: bool = False) -> None:
        """Fill the head's entries that the target forward (tokens `inputs` (B, L) at
        `offsets`, final hidden states `hidden` (B, L, H)) makes known; carry its last
        hidden states in the sequences (a verify row's all: which it resumes from
        depends on how many drafts are accepted)."""
        carried = [self._hidden_at(s, o - 1) for s, o in zip(seqs, offsets)]
        with_prev = [i for i, h in enumerate(carried) if h is not None]
        fresh = [i for i, h in enumerate(carried) if h is None]
        if with_prev:
            idx = mx.array(with_prev)
            prev = mx.stack([carried[i] for i in with_prev])[:, None]
            states = mx.concatenate([prev, hidden[idx, : L - 1]], axis=1) if L > 1 else prev
            self._run(inputs[idx], states, [seqs[i] for i in with_prev], [offsets[i] - 1 for i in with_prev], L)
        if fresh and L > 1:
            idx = mx.array(fresh)
            self._run(inputs[idx, 1:], hidden[idx, : L - 1], [seqs[i] for i in fresh], [offsets[i] for i in fresh],
                      L - 1)
        keep = L if verify else 1
        for i, s in enumerate(seqs):
            s.hidden = (hidden[i, L - keep :], offsets[i] + L - keep)

    def draft(self, seqs: Sequence, positions: Sequence[int], k: int, dispatch: Callable[..., None]) -> mx.array:
        """(rows, k) greedy drafts after each row's last token at `positions`."""
        token = mx.array([[s.tokens[-1]] for s in seqs], mx.int32)
        carried = [self._hidden_at(s, p - 1) for s, p in zip(seqs, positions)]
        zeros = self.no_state
        state = mx.stack([zeros if h is None else h for h in carried])[:, None]
        drafts = []
        for i in range(k):
            state = self._run(token, state, seqs, [p - 1 + i for p in positions], 1)
            token = rank0s(mx.argmax(self.head.logits(state[:, -1:], self.output_head), axis=-1).astype(mx.int32),
                           self.group)
            drafts.append(token)
            dispatch(token)
        return mx.concatenate(drafts, axis=1)

    def _run(self, tokens: mx.array, states: mx.array, seqs: Sequence, offsets: Sequence[int], L: int) -> mx.array:
        self.num_forwards += 1
        embeddings = self.embed(tokens)
        if self.head.zero_first_position and 0 in offsets:  # as vLLM's DeepSeek MTP: position 0 sees no token
            keep = mx.array([[o + j > 0 for j in range(L)] for o in offsets])
            embeddings = embeddings * keep[..., None].astype(embeddings.dtype)
        return self.head(embeddings, states, self.kv.forward(seqs, offsets, L).caches)

    @staticmethod
    def _hidden_at(seq, position: int) -> Optional[mx.array]:
        if seq.hidden is None or position < 0:
            return None
        states, start = seq.hidden
        return states[position - start] if start <= position < start + states.shape[0] else None
