"""Every architecture the installed mlx-lm ships, built from a minimal config, serves
rows at different positions in one batch with greedy tokens equal to mlx-lm's own. A new
mlx-lm release that adds an architecture fails the coverage test until a config is added
here (tests/arch_configs.py); one that adds a cache kind fails its architecture's run."""

import random
from pathlib import Path

import mlx_lm.models
import pytest
from arch_configs import ARCH_CONFIGS, UNBUILDABLE
from conftest import reference_greedy, run_requests
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig

# Served, but not token for token: mlx-lm's own output depends on how it splits the prompt.
NOT_EXACT = {
    "plamo3": "mlx-lm masks its prefill with window + 1 positions but keeps only `window` in decode, "
              "and feeds the prompt's last token as a decode step; the engine masks every prefill alike",
}

# Refused at load with a clear error: a cache kind of their own that the engine does not page.
REFUSED = {
    "deepseek_v41": "LayerCache: a sliding window plus compressed KV groups and their index keys",
}


def shipped_architectures():
    folder = Path(mlx_lm.models.__file__).parent
    return {f.stem for f in folder.glob("*.py")
            if "\nclass Model(" in (text := f.read_text()) and "\nclass ModelArgs" in text}


def test_every_shipped_architecture_has_a_config_or_a_reason():
    assert shipped_architectures() - set(ARCH_CONFIGS) - set(UNBUILDABLE) == set()


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_architecture_serves_a_ragged_batch(arch):
    model = make_tiny_model(arch)
    if arch in REFUSED:
        with pytest.raises(NotImplementedError, match=REFUSED[arch].split(":")[0]):
            Engine(EngineConfig(max_total_tokens=2048), model=model)
        return
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 23, 41)]
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    outs = run_requests(eng, prompts, 6)
    assert all(last.finish_reason == "length" for _, last in outs)
    if arch not in NOT_EXACT:
        assert [toks for toks, _ in outs] == [reference_greedy(model, p, 6) for p in prompts]
    assert eng.stats()["kv_pages_used"] == 0
    eng.shutdown()
