"""The user's path: `serve run` on deploy/app.yaml, through Serve's own config loading."""

from pathlib import Path

import pytest
import yaml
from openai import OpenAI
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray._common.utils import import_attr
from ray.serve import Application
from serve_fixtures import free_port, serve_run, tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "deploy" / "app.yaml").read_text())
APP = CONFIG["applications"][0]


def build_as_serve_does(args):
    return call_user_app_builder_with_args_if_necessary(import_attr(APP["import_path"]), args)


def test_the_config_builds_through_serves_builder_call():
    assert isinstance(build_as_serve_does(APP["args"]), Application)


def test_bad_config_args_are_named():
    with pytest.raises(ValidationError, match="router"):
        build_as_serve_does({**APP["args"], "router": "fastest"})


def test_serve_run_of_the_shipped_config(tmp_path_factory):
    """deploy/app.yaml as shipped; only the model (tiny) and KV size are swapped in."""
    cfg = yaml.safe_load((ROOT / "deploy" / "app.yaml").read_text())
    port = free_port()
    cfg["http_options"] = {**cfg["http_options"], "host": "127.0.0.1", "port": port}
    args = cfg["applications"][0]["args"]
    args["model"] = str(tiny_model_dir(tmp_path_factory))
    args["engine"] = {**args["engine"], "max_total_tokens": 4096}
    path = tmp_path_factory.mktemp("config") / "app.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serve_run(path, port, ROOT) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=5, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
