"""A vision-language model of mlx-vlm's, as the engine runs it: its language model in the
batched paged step like any text model, its vision tower turning a prompt's images into
the embeddings that take the image tokens' places (mlx-vlm's `get_input_embeddings`)."""

import inspect
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .image_cache import ImageCache
from .image_features import image_features
from .image_inputs import ImageInputs
from .prompt import images_attend_both_ways, vision_prompt

# The vision families served: their language models take the engine's per-row positions
# as they are (one RoPE position a token), or M-RoPE positions (Qwen-VL: three a token,
# from the images' grids) that `position_ids` makes per row, never kept in module state.
FAMILIES = ("gemma3", "gemma4", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "idefics3", "smolvlm", "mistral3", "pixtral", "lfm2-vl")


def is_vision_checkpoint(spec: str) -> bool:
    """Whether a local directory or a Hugging Face id (its config.json fetched, before the
    weights) is a vision-language checkpoint."""
    path = Path(spec)
    if not path.exists():
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(spec, "config.json")).parent
        except Exception:  # noqa: BLE001 - not a repo, or offline: mlx-lm's load says why
            return False
    config = path / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


class VisionLanguageModel(nn.Module):
    """mlx-vlm's model behind the interface the engine calls on mlx-lm's: `model(inputs,
    cache)` gives logits, `make_cache()` mlx-lm's cache kinds, and `language_model` the
    text model whose body and head the engine splits."""

    def __init__(self, vlm: nn.Module, processor, image_cache_bytes: int = 256 << 20):
        super().__init__()
        self.vlm = vlm
        self._processor = processor  # underscored: not a module
        self._features = image_features(vlm.config.model_type)
        self.image_cache = ImageCache(image_cache_bytes)
        self.tower_calls = 0  # calls of the vision tower (each on one or more images)
        self.mrope = hasattr(vlm.language_model, "get_rope_index")
        # Gemma 4's larger checkpoints: an image's tokens go into one chunk, however long the step.
        self.image_block_tokens = getattr(getattr(processor, "image_processor", None), "max_soft_tokens", 0) \
            if images_attend_both_ways(vlm.config) else 0
        body = getattr(vlm.language_model, "model", None)  # Idefics3's text model has no separate body
        body_args = inspect.signature(body.__call__).parameters if body is not None else {}
        self._embeddings_arg = "inputs_embeds" if "inputs_embeds" in body_args else "input_embeddings"  # LFM2's
        self._per_layer_inputs = bool(getattr(body, "hidden_size_per_layer_input", 0))  # Gemma 4 E2B/E4B
        config = vlm.config
        self._image_token_ids = [t for t in (getattr(config, "image_token_index", None) or
                                             getattr(config, "image_token_id", None),
                                             getattr(config, "video_token_index", None) or
                                             getattr(config, "video_token_id", None)) if t is not None]

    @property
    def language_model(self) -> nn.Module:
        return self.vlm.language_model

    @property
    def processor(self):
        return self._processor

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None,
                 position_ids: Optional[mx.array] = None, **extra) -> mx.array:
        if not self.mrope:
            return self.language_model(inputs, inputs_embeds=input_embeddings, cache=_vlm_state_caches(cache),
                                       **extra).logits
        lm = self.language_model
        out = self.body(inputs, cache, input_embeddings, position_ids, **extra)
        tied = getattr(getattr(lm, "args", None), "tie_word_embeddings", "lm_head" not in lm)
        return lm.model.embed_tokens.as_linear(out) if tied else lm.lm_head(out)

    def body(self, inputs: mx.array, cache, input_embeddings: Optional[mx.array] = None,
             position_ids: Optional[mx.array] = None, **extra) -> mx.array:
        """The final hidden states (the engine applies the head where it samples). `extra`:
        deepstack features (Qwen3-VL), per-layer inputs (Gemma 4)."""
        kw = {self._embeddings_arg: input_embeddings, **extra}
        if self.mrope:
            if position_ids is None:  # rows without images (the engine's probes): plain positions
                position_ids = mx.array(plain_positions(cache, *inputs.shape))
            kw["position_ids"] = position_ids
        return self.language_model.model(inputs, cache=_vlm_state_caches(cache), **kw)

    def forward_kwargs(self, seqs, offsets, L: int, embeds: Optional[mx.array]) -> dict:
        """What a forward of these rows passes besides token ids: the rows' input embeddings
        where they show images (and, Qwen3-VL, the image features its first layers add:
        deepstack; Gemma 4, the per-layer inputs of their ids, image tokens as 0, as mlx-vlm
        computes them), and (M-RoPE) every row's positions."""
        kw = {}
        tokens = np.array([s.tokens[o : o + L] for s, o in zip(seqs, offsets)]) if embeds is not None else None
        if embeds is not None and self._per_layer_inputs:
            text = np.where(np.isin(tokens, self._image_token_ids), 0, tokens)
            kw["per_layer_inputs"] = self.language_model.model.get_per_layer_inputs(mx.array(text))
        if embeds is not None and embeds.ndim == 4:  # (B, L, 1 + deepstack layers, hidden)
            B, _, K, H = embeds.shape
            shown = np.isin(tokens, self._image_token_ids)
            where = mx.array(np.flatnonzero(shown))
            kw["visual_pos_masks"] = mx.array(shown)
            kw["deepstack_visual_embeds"] = [embeds[:, :, k].reshape(B * L, H)[where] for k in range(1, K)]
            embeds = embeds[:, :, 0]
        if embeds is not None:
            kw["input_embeddings"] = embeds
        if self.mrope:
            kw["position_ids"] = mx.array(np.stack([self._positions(s, o, L) for s, o in zip(seqs, offsets)], 1))
        return kw

    def _positions(self, seq, start: int, L: int) -> np.ndarray:
        """(3, L): M-RoPE positions of seq's tokens start .. start + L - 1. A prompt's come
        from mlx-vlm's `get_rope_index` over its images' grids (computed once a request);
        a token after the prompt is at its index plus the prompt's delta."""
        if seq.mrope is None:
            seq.mrope = (None, 0)
            if seq.images is not None:
                grid = seq.images.arrays.get("image_grid_thw")
                pos, delta = self.language_model.get_rope_index(
                    mx.array([seq.tokens[: seq.num_prompt]]), None if grid is None else mx.array(grid), None, None)
                seq.mrope = (np.array(pos[:, 0, :]), int(np.array(delta).reshape(-1)[0]))
        table, delta = seq.mrope
        index = np.arange(start, start + L)
        out = np.broadcast_to(index + delta, (3, L)).copy()
        if table is not None:
            inside = index < table.shape[1]
            out[:, inside] = table[:, index[inside]]
        return out

    def make_cache(self) -> list:
        lm = self.language_model
        if not hasattr(lm, "make_cache"):  # as mlx-lm's make_prompt_cache: one KVCache a layer
            return [mlx_cache.KVCache() for _ in lm.layers]
        return [_as_mlx_lm(c) for c in lm.make_cache()]

    def prompt(self, text: str, images: List) -> Tuple[List[int], ImageInputs]:
        """(prompt ids, image inputs) of a rendered chat prompt and its decoded images."""
        return vision_prompt(self._processor, self.vlm.config, text, images)

    def encode_new_images(self, prompts: List[ImageInputs]) -> Dict[str, mx.array]:
        """By hash, the features of the images of these prompts that the image cache lacks,
        each image once however many prompts show it, from one call of the vision tower
        (still lazy), where the family can batch the images of several prompts (`gather`);
        they enter the image cache too. Empty when fewer than two prompts have images to
        encode: one prompt's are encoded together by `prompt_embeddings`."""
        gather = getattr(self._features, "gather", None)
        parts, seen = [], set()
        for images in prompts if gather is not None else ():
            if not self._cacheable(images):
                continue  # encoded whole with its prompt (prompt_embeddings)
            which = [i for i, h in enumerate(images.hashes) if h not in seen and not self.image_cache.holds(h)]
            seen.update(images.hashes[i] for i in which)
            if which:
                parts.append((images, which))
        if len(parts) < 2:
            return {}
        arrays = gather([(_arrays(images), which) for images, which in parts])
        if arrays is None:  # the family cannot batch these (idefics3.py: tiles of different sizes)
            return {}
        hashes = [images.hashes[i] for images, which in parts for i in which]
        features = self._features.encode(self.vlm, arrays, list(range(len(hashes))))
        self.tower_calls += 1
        for h, f in zip(hashes, features):
            self.image_cache.put(h, f)
        return dict(zip(hashes, features))

    def prompt_embeddings(self, prompt_ids: List[int], images: ImageInputs,
                          fresh: Optional[Dict[str, mx.array]] = None) -> mx.array:
        """(len(prompt_ids), hidden): the text tokens' embeddings with the images' in their
        tokens' places, as mlx-vlm's generation computes them (still lazy). `fresh`: images
        this step encoded already (`encode_new_images`), by hash."""
        arrays = _arrays(images)
        ids = mx.array([prompt_ids])
        cached = {}
        if self._cacheable(images):
            fresh = fresh or {}  # images encoded before are not encoded again
            features = [fresh.get(h) for h in images.hashes]
            missing = [i for i, f in enumerate(features) if f is None]
            for i, f in zip(missing, self.image_cache.get([images.hashes[i] for i in missing])):
                features[i] = f
            missing = [i for i, f in enumerate(features) if f is None]
            if missing:
                self.tower_calls += 1
                for i, f in zip(missing, self._features.encode(self.vlm, arrays, missing)):
                    features[i] = f
                    self.image_cache.put(images.hashes[i], f)
            cached["cached_image_features"] = self._features.join(features)
        arrays.pop("crops", None)
        out = self.vlm.get_input_embeddings(ids, arrays.pop("pixel_values"), mask=mx.ones(ids.shape, mx.int32),
                                            **arrays, **cached)
        deepstack = getattr(out, "deepstack_visual_embeds", None)
        if deepstack is None and hasattr(self._features, "deepstack"):  # mlx-vlm's cached path drops them
            deepstack = self._features.deepstack(features)
        if deepstack is None:
            return out.inputs_embeds[0]
        # Deepstack: per layer, the features it adds at the image tokens, kept beside the
        # embeddings as (tokens, 1 + layers, hidden), zero where no image is shown.
        shown = mx.array(np.flatnonzero(np.array(out.visual_pos_masks[0])))
        layers = mx.zeros((len(deepstack), len(prompt_ids), out.inputs_embeds.shape[-1]), out.inputs_embeds.dtype)
        layers[:, shown] = mx.stack(list(deepstack)).astype(layers.dtype)
        return mx.concatenate([out.inputs_embeds, layers]).transpose(1, 0, 2)

    def tower_tokens(self, images: ImageInputs) -> int:
        """The image tokens of a prompt's images that its vision tower would encode now:
        those the image cache lacks (all of them where the prompt's are encoded whole)."""
        cached = self._cacheable(images)
        spans = {span for span, h in zip(images.spans, images.hashes) if not (cached and self.image_cache.holds(h))}
        return sum(e - s for s, e in spans)  # a span once: where it is not known whose tokens are whose, all share it

    def _cacheable(self, images: ImageInputs) -> bool:
        """Whether its images' features can be had one by one (and cached): the family has
        a module here, and where it tiles images, this prompt shows which tiles are whose."""
        return self._features is not None and (images.crops is not None or not hasattr(self._features, "crops"))

    def stats(self) -> dict:
        return {**self.image_cache.stats(), "tower_calls": self.tower_calls}


def _arrays(images: ImageInputs) -> dict:
    """A prompt's image arrays as MLX arrays (Gemma 4's images of different sizes: a list),
    and where the family tiles images, each image's rows (`crops`)."""
    arrays = {k: [mx.array(x) for x in v] if isinstance(v, list) else mx.array(v) for k, v in images.arrays.items()}
    return {**arrays, "crops": images.crops} if images.crops is not None else arrays


def plain_positions(cache, B: int, L: int) -> np.ndarray:
    """(3, B, L): each row's positions from its cache offset, the same on all three axes."""
    offset = getattr(cache[0], "offset", 0) if cache else 0
    offsets = np.array(offset).reshape(-1) if isinstance(offset, mx.array) else np.full(B, offset)
    return np.broadcast_to(offsets[None, :, None] + np.arange(L)[None, None], (3, B, L)).copy()


def _vlm_state_caches(cache):
    """mlx-vlm's recurrent layers (Qwen3.5's) call its own ArraysCache's methods
    (`update_window`, `advance`): the engine's state caches (mlx-lm's) go in behind one
    that shares their list of arrays, so what the layer leaves is where the engine reads."""
    if not cache or not any(type(c) is mlx_cache.ArraysCache for c in cache):
        return cache
    from mlx_vlm.models.cache import ArraysCache

    out = []
    for c in cache:
        if type(c) is mlx_cache.ArraysCache:
            shared = ArraysCache(len(c.cache))
            shared.cache = c.cache
            c = shared
        out.append(c)
    return out


def _as_mlx_lm(c):
    """mlx-vlm's cache objects are its own classes: mlx-lm's of the same kind, which the
    engine reads the model's layout from (model_caches.probe_caches)."""
    kind = type(c).__name__
    if kind == "KVCache":
        return mlx_cache.KVCache()
    if kind == "RotatingKVCache":
        return mlx_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if kind == "ChunkedKVCache":
        return mlx_cache.ChunkedKVCache(c.chunk_size)
    if kind == "ArraysCache":
        return mlx_cache.ArraysCache(len(c.cache))
    if kind == "CacheList":
        return mlx_cache.CacheList(*(_as_mlx_lm(x) for x in c.caches))
    raise NotImplementedError(f"mlx-vlm's {kind} layers are not supported yet")


def load_vision_model(path: str):
    """(VisionLanguageModel, mlx-lm TokenizerWrapper) of a vision checkpoint directory;
    the processor (chat template, image preprocessing) rides on the model."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_vlm.utils import load as vlm_load

    vlm, processor = vlm_load(path)
    model_type = vlm.config.model_type
    if model_type not in FAMILIES:
        raise ValueError(f"vision model type {model_type!r} is not served yet (served: {', '.join(FAMILIES)})")
    eos = vlm.config.eos_token_id
    eos = [eos] if isinstance(eos, int) else eos
    return VisionLanguageModel(vlm, processor), TokenizerWrapper(processor.tokenizer, eos_token_ids=eos)
