"""The configuration reference and the strictness of every configuration model."""

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from mlx_worker import EngineConfig
from serve_app.config import AppArgs

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_page_is_generated_from_the_models():
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "make_configuration.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    page = (ROOT / "docs" / "configuration.md").read_text()
    for key in list(EngineConfig.model_fields) + list(AppArgs.model_fields):
        assert f"| `{key}` |" in page


@pytest.mark.parametrize("build, named, hint", [
    (lambda: EngineConfig(max_batched_token=5), "max_batched_token", "max_batched_tokens"),
    (lambda: AppArgs(modle="x"), "modle", "model"),
    (lambda: AppArgs(engine={"kv_memory_fractoin": 0.3}), "kv_memory_fractoin", "kv_memory_fraction"),
    (lambda: AppArgs(replica_groups=[{"name": "pair", "engine": {"tensor_paralel_size": 2}}]),
     "tensor_paralel_size", "tensor_parallel_size"),
    (lambda: AppArgs(router_kwargs={"page_wieght": 2}), "page_wieght", "page_weight"),
])
def test_an_unknown_key_is_an_error_that_names_it_and_the_nearest(build, named, hint):
    with pytest.raises(ValidationError) as e:
        build()
    assert repr(named) in str(e.value)
    if hint:
        assert f"did you mean {hint!r}" in str(e.value)


def test_deploy_app_yaml_is_valid():
    import yaml

    cfg = yaml.safe_load((ROOT / "deploy" / "app.yaml").read_text())
    args = AppArgs.model_validate(cfg["applications"][0]["args"])
    assert EngineConfig.model_validate(args.engine).request_timeout_s == 300


@pytest.mark.parametrize("model, name", [
    (None, "SmolLM2-135M-Instruct"),
    ("mlx-community/Qwen2.5-7B-Instruct-4bit", "Qwen2.5-7B-Instruct-4bit"),  # not cut at its last dot
    ("/models/llama-3.2-1b.Q4_0.gguf", "llama-3.2-1b.Q4_0"),
    ("/models/tiny-dir", "tiny-dir"),
])
def test_the_served_model_name_defaults_to_the_models_last_path_part(model, name):
    from serve_app.model_files import served_name

    assert served_name(model) == name


def test_the_team_farm_of_docs_models_md_is_a_valid_config():
    """The YAML users copy from docs/models.md builds (as far as args go) and names what it says."""
    import re

    import yaml

    text = (ROOT / "docs" / "models.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    args = AppArgs.model_validate(yaml.safe_load(block)["applications"][0]["args"])
    names = [n for m in args.served_models() for n in (m.name, *m.adapters)]
    assert names == ["coder", "coder-sql", "coder-acme", "small", "embed", "last-month"]
    assert args.for_model(args.models[0]).engine["adapters"] == args.models[0].adapters


@pytest.mark.parametrize("args, message", [
    ({"model": "x", "models": [{"name": "a"}]}, "model beside models"),
    ({"models": [{"name": "a", "adapters": {"a": "/p"}}]}, "two models or adapters have the name 'a'"),
    ({"models": [{"name": "a"}, {"name": "b", "adapters": {"a": "/p"}}]}, "the name 'a'"),
    ({"models": [{"name": "a:b"}]}, "should match pattern"),
    ({"models": [{"name": "a", "engine": {"max_batched_token": 1}}]}, "did you mean 'max_batched_tokens'"),
    ({"models": [{"name": "a", "num_replicas": 1, "min_replicas": 2}]}, "above its num_replicas"),
])
def test_a_wrong_models_list_is_an_error_that_says_why(args, message):
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate(args)


@pytest.mark.parametrize("spec, message", [
    ({"num_draft_tokens": 0}, "greater than or equal to 1"),
    ({"num_draft_tokens": 17}, "less than or equal to 16"),
    ({"method": "draft"}, "method 'draft' needs draft_model"),
    ({"method": "ngram", "draft_model": "x"}, "draft_model is used by method 'draft' only"),
    ({"method": "mtp", "draft_model": "x"}, "draft_model is used by method 'draft' only"),
    ({"method": "eagle"}, "'ngram', 'suffix', 'draft' or 'mtp'"),
    ({"num_draft_token": 3}, "did you mean 'num_draft_tokens'"),
])
def test_the_speculative_section_is_checked_at_startup(spec, message):
    args = AppArgs(engine={"speculative": {"method": "suffix", "num_draft_tokens": 8}})
    assert EngineConfig.model_validate(args.engine).speculative.num_draft_tokens == 8
    assert EngineConfig().speculative is None  # off unless asked for
    with pytest.raises(ValidationError, match=message):
        AppArgs(engine={"speculative": spec})
