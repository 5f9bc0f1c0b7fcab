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
            known = set(cls.model_fields)
            for key in data:
                if key not in known:
                    near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                    hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(sorted(known))}"
                    raise ValueError(f"unknown {cls.__name__} key {key!r}{hint}")
        return data
