"""Splitting a model into body and output head: exact, and refused when it would not be."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny_models import CONFIGS, make_tiny_model

from mlx_worker.models.output_head import split_output_head


@pytest.mark.parametrize("arch", sorted(a for a in CONFIGS if a != "gpt_bigcode"))
def test_head_of_body_equals_the_model(arch):
    model = make_tiny_model(arch)
    body, head = split_output_head(model)
    x = mx.array([[5, 17, 300, 4000, 9]])
    hidden = body(x, None)
    assert hidden.shape[-1] == CONFIGS[arch]["hidden_size"]
    assert mx.array_equal(head(hidden[:, -1, :]), model(x)[:, -1, :])


def test_a_model_without_the_usual_body_keeps_the_full_call():
    assert split_output_head(make_tiny_model("gpt_bigcode")) is None  # its body is `transformer`


class SoftCapped(nn.Module):
    """A model that changes the logits after its head (as Gemma 2's soft-capping does)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.model, self.lm_head = inner.model, inner.lm_head  # the usual parts, then more

    def __call__(self, x, cache=None):
        return 30 * mx.tanh(self.inner(x, cache=cache) / 30)


def test_a_model_with_more_after_its_head_keeps_the_full_call():
    assert split_output_head(SoftCapped(make_tiny_model("llama"))) is None


def test_a_model_without_a_body_keeps_the_full_call():
    assert split_output_head(nn.Linear(4, 4)) is None
