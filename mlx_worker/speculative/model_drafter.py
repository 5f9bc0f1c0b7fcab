"""Methods draft and mtp: a model that drafts inside the step, with KV of its own on the
target's pages (draft_model.py, mtp_drafter.py). Loaded before the pool is sized (its
weights and KV count in it), built once the pool's pages and the target's batching are
known."""

from dataclasses import dataclass
from typing import Callable, List, Optional

from mlx.utils import tree_flatten

from ..models.batch_probe import RAGGED_HEAD_GROUPS, UNIFORM
from .draft_model import DraftModel, load_draft_model
from .mtp_drafter import MTPDrafter, mtp_head_specs
from .mtp_head import checkpoint_files, load_mtp_head


@dataclass
class LoadedDrafter:
    weights_bytes: int
    kv_specs: List  # its attention layers' KV shapes, beside the target's in every page
    build: Callable[[int, str], object]  # (pages, the target's batching) -> the drafter


def load_model_drafter(config, model, tokenizer, draft_model=None, group=None) -> Optional[LoadedDrafter]:
    """The drafter of `config.speculative` if it is a model (`draft_model`: one already
    loaded), else None; a ValueError that says why it cannot draft. `group`: the ranks
    of a sharded replica, each of which holds the whole draft model or MTP head."""
    spec = config.speculative
    if spec is None or spec.method not in ("draft", "mtp"):
        return None
    if spec.method == "draft":
        draft_model, tree, head_groups = load_draft_model(spec.draft_model, config.dtype, tokenizer, draft_model)
        return LoadedDrafter(_nbytes(draft_model), tree.kv, lambda pages, batching: DraftModel(
            draft_model, tree, pages, config.page_size, head_groups, group))
    head = load_mtp_head(model, checkpoint_files(config.model))

    def build(pages: int, batching: str) -> MTPDrafter:
        if batching == UNIFORM:
            raise ValueError("speculative method 'mtp' needs a model that batches rows at different positions")
        return MTPDrafter(model, head, pages, config.page_size, batching == RAGGED_HEAD_GROUPS, group)

    return LoadedDrafter(_nbytes(head), mtp_head_specs(head, model), build)


def _nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))
