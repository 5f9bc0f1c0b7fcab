"""The user's path: deploy/app.yaml through Serve's own config loading (`serve run` of it
is in test_served_under_load.py)."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray._common.utils import import_attr
from ray.serve import Application

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


# `serve run` of the shipped config itself: tests/test_served_under_load.py (one cluster for both).
