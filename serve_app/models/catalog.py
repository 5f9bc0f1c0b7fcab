"""Names to models: the `model` a request sends picks a served model and, maybe, one of
its LoRA adapters: a model's name, an adapter's name, or `base:adapter`."""

import time
from dataclasses import dataclass
from typing import List, Optional

from ..api import protocol as P
from .served_model import ServedModel


@dataclass
class Target:
    model: ServedModel
    adapter: Optional[str]
    name: str  # what responses echo: the `model` the client sent (the first model's name if none)


class Catalog:
    def __init__(self, models: List[ServedModel]):
        self.models = {m.name: m for m in models}
        self.default = models[0]
        self.base_of = {a: m for m in models for a in m.adapters}
        self.created = int(time.time())

    def resolve(self, name: Optional[str]) -> Target:
        """The model and adapter `name` picks; 404 (ProtocolError) when it names none."""
        if not name:
            return Target(self.default, None, self.default.name)
        if name in self.models:
            return Target(self.models[name], None, name)
        if name in self.base_of:
            return Target(self.base_of[name], name, name)
        for m in self.models.values():  # the model's path or HF id, as configured
            if m.entry.model and name == m.entry.model:
                return Target(m, None, name)
        base, sep, adapter = name.partition(":")
        if sep and base in self.models:
            if adapter in self.models[base].adapters:
                return Target(self.models[base], adapter, name)
            other = self.base_of.get(adapter)
            where = f"; it is an adapter of {other.name!r}" if other else ""
            raise P.ProtocolError(f"model {base!r} has no adapter {adapter!r}{where}", "model", "model_not_found",
                                  status=404)
        raise P.ProtocolError(f"model {name!r} does not exist; this server serves {self.names()}", "model",
                              "model_not_found", status=404)

    def names(self) -> List[str]:
        return [n for m in self.models.values() for n in (m.name, *m.adapters)]

    def listing(self, loaded) -> List[dict]:
        """/v1/models entries: each model, then its adapters (`parent`: their base, as
        vLLM lists them); `loaded(model, adapter)`: whether it is resident now (None: unknown)."""
        out = []
        for m in self.models.values():
            out.append({"id": m.name, "object": "model", "created": self.created, "owned_by": "macfarm",
                        "root": m.entry.model or m.name, "parent": None, "loaded": loaded(m, None)})
            for a in m.adapters:
                out.append({"id": a, "object": "model", "created": self.created, "owned_by": "macfarm",
                            "root": m.adapters[a], "parent": m.name, "loaded": loaded(m, a)})
        return out
