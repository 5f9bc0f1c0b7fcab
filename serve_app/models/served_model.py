"""What the ingress keeps of one served model: its tokenizer and chat-template facts, its
replica deployments (one per replica group) and the LoRA adapters it serves."""

from pathlib import Path
from typing import Dict, List, Optional

from ray.serve.handle import DeploymentHandle

from mlx_worker.memory.paging import PAGE_SIZE, adapter_root, page_hashes

from ..api import embeddings as E
from ..api import tools as T
from ..api.harmony import HarmonyParser, is_harmony
from ..api.output_parser import OutputParser, starts_in_reasoning, think_format
from ..config import AppArgs, ModelArgs
from ..model_files import context_length, download_tokenizer
from ..routing.replica_groups import GroupPicker
from ..vision.prompter import vision_prompter


class ServedModel:
    def __init__(self, entry: ModelArgs, args: AppArgs, replicas: Dict[str, DeploymentHandle],
                 weights: Optional[Dict[str, float]] = None):
        from mlx_lm.utils import load_tokenizer

        from mlx_worker.models.gguf import resolve_model

        self.entry, self.args = entry, args
        self.name = entry.name
        self.adapters = dict(entry.adapters)
        path = resolve_model(entry.model)
        local = Path(path) if Path(path).exists() else download_tokenizer(path)  # tokenizer + config only
        self.tokenizer = load_tokenizer(local)
        self.max_model_len = context_length(local)
        self.vocab_size = len(self.tokenizer._tokenizer)
        self.page_size = int(args.engine.get("page_size", PAGE_SIZE))
        # One deployment per replica group (app.py): several when replicas differ in size.
        self.deployments = list(replicas)
        self.generate = {g: h.options(stream=True, method_name="generate") for g, h in replicas.items()}
        self.embed = {g: h.options(method_name="embed") for g, h in replicas.items()}
        self.stats_handles = {g: h.options(method_name="stats") for g, h in replicas.items()}
        self.evict = {g: h.options(method_name="evict") for g, h in replicas.items()}
        self.resident_adapters = {g: h.options(method_name="resident_adapters") for g, h in replicas.items()}
        self.groups = GroupPicker(weights or {g: 1.0 for g in replicas}) if len(replicas) > 1 else None
        self.harmony = is_harmony(self.tokenizer)  # gpt-oss
        self.call_format = T.HARMONY_CALLS if self.harmony else T.call_format(self.tokenizer)
        self.think = think_format(self.tokenizer)
        self.pooling = E.pooling(local)
        self.vision = vision_prompter(local, args.images)  # None: a text model

    def parser_factory(self, prompt_ids: List[int], tools):
        """Makes a sample's OutputParser (reasoning, content, tool calls); None when the
        model has no thinking markers and there are no tools: the text is all content."""
        if self.harmony:
            return HarmonyParser
        if not (self.think or tools):
            return None
        in_reasoning = starts_in_reasoning(self.tokenizer, prompt_ids)
        return lambda: OutputParser(self.think, self.call_format, tools, in_reasoning)

    def page_hashes(self, prompt_ids: List[int], adapter: Optional[str], images=None) -> List[int]:
        """The router's page hashes of a prompt, chained from its adapter's root as the
        engine's are (a replica holds an adapter's pages apart from the base's). Under an
        adapter the root comes first: replicas report the roots of their resident
        adapters with their pages, so a prompt none has cached still goes where its
        adapter is loaded."""
        root = adapter_root(adapter)
        salts = images.page_salts(len(prompt_ids), self.page_size) if images is not None else ()
        hashes = page_hashes(prompt_ids, self.page_size, root, salts)
        return hashes if root is None else [root, *hashes]
