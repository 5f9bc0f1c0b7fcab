"""A small model that drafts for the target (method draft), run by the same engine.

Its KV lives in a pool of its own whose pages are the target's: page i of a sequence
holds the draft's KV for the same tokens as the target's page i. Every forward the target
runs (prefill chunks, decode rows, replays) the draft runs on the same tokens, body only
(`mirror`), so wherever the target's KV is valid the draft's is too, through prefix
hits and preemption, with no bookkeeping of its own. A verify row's k drafts come from
k + 1 one-token forwards (`draft`): the last only writes the KV of the last draft, the
position the target verifies too. Drafts are greedy: a draft is accepted when the
target samples it, which keeps the output exactly the target's.

On a sharded replica every rank holds the whole draft model and runs it alike; each
draft token is rank 0's (an all_sum in the graph), so every rank verifies the same
drafts and keeps the same draft KV even if their arithmetic differed.
"""

from typing import Callable, Sequence

import mlx.core as mx

from ..distributed.ranks import rank0s
from ..memory.kv_pool import KVPool
from ..memory.model_caches import CacheTree, probe_caches
from ..memory.step_kv import StepKV
from ..models.batch_probe import RAGGED_HEAD_GROUPS, UNIFORM, probe_batching
from ..models.loader import load_model
from ..models.output_head import split_output_head


class DraftModel:
    def __init__(self, model, tree: CacheTree, num_pages: int, page_size: int, head_groups: bool, group=None):
        self.model, self.tree, self.group = model, tree, group
        self.weights = model  # what its KV is computed with (the SSD tier's key)
        self.pool = KVPool(tree.kv, tree.kv_dtype, num_pages, page_size)
        self.kv = StepKV(self.pool, tree, head_groups=head_groups)
        split = split_output_head(model)
        self.body, self.head = split or ((lambda x, cache: model(x, cache=cache)), None)
        self.num_forwards = 0

    needs_hidden = False  # of the target's forwards

    def mirror(self, inputs: mx.array, seqs: Sequence, offsets: Sequence[int], L: int, hidden=None,
               verify: bool = False) -> None:
        """Run the target's forward on the draft for its KV writes (still lazy: the
        pool's new arrays are dispatched with the target's). A verify forward's tokens
        it has drafted already."""
        if verify:
            return
        self.body(inputs, self.kv.forward(seqs, offsets, L).caches)
        self.num_forwards += 1

    def draft(self, seqs: Sequence, positions: Sequence[int], k: int,
              dispatch: Callable[..., None]) -> mx.array:
        """(rows, k) greedy drafts after each row's last token, fed at `positions`; each
        forward dispatched on its own (it writes the pool the next one reads)."""
        x = mx.array([[s.tokens[-1]] for s in seqs], mx.int32)
        drafts = []
        for i in range(k + 1):
            out = self.body(x, self.kv.forward(seqs, [p + i for p in positions], 1).caches)
            self.num_forwards += 1
            if i == k:
                dispatch()  # the last draft's KV only
                break
            logits = self.head(out) if self.head is not None else out
            x = rank0s(mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32), self.group)
            drafts.append(x)
            dispatch(x)
        return mx.concatenate(drafts, axis=1)


def load_draft_model(spec: str, dtype: str, target_tokenizer, model=None) -> tuple:
    """(model, cache tree, head groups) of `speculative.draft_model` (or of `model`, one
    already loaded), or a ValueError that says why it cannot draft for the target."""
    if model is None:
        model, tokenizer = load_model(spec, dtype)
        if target_tokenizer is not None and not same_vocabulary(tokenizer, target_tokenizer):
            raise ValueError(f"speculative.draft_model {spec!r} has another tokenizer than the model: "
                             "a draft model must give every token the same id")
    return (model, *check_draft_model(model))


def check_draft_model(model) -> tuple:
    """(cache tree, head groups) of a model that can draft, or a ValueError: attention
    only (its KV follows the target's pages) and able to batch rows at any position."""
    tree = probe_caches(model)
    if tree.states:
        raise ValueError("speculative.draft_model has recurrent layers: a draft model must be attention-only")
    if not tree.kv:
        raise ValueError("speculative.draft_model has no attention layers")
    batching = probe_batching(model, tree)
    if batching == UNIFORM:
        raise ValueError("speculative.draft_model cannot batch rows at different positions")
    return tree, batching == RAGGED_HEAD_GROUPS


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers give every token the same id (a draft must speak the target's ids)."""
    try:
        return a.get_vocab() == b.get_vocab()
    except AttributeError:
        return a is b
