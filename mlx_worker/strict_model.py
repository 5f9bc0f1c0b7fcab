"""Configuration models that reject what they do not know.

A misspelt key in a YAML config would otherwise run the defaults in silence; here it is
an error that names the key and the nearest valid one. Each field's docstring is its
description (docs/configuration.md is generated from them).
"""

import difflib

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        if isinstance(data, dict):
            check_keys(cls, data)
        return data


def check_keys(model: type, data: dict) -> None:
    """Raise ValueError naming the first key of `data` that `model` has no field for."""
    known = sorted(model.model_fields)
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(known)}"
            raise ValueError(f"unknown {model.__name__} key {key!r}{hint}")
