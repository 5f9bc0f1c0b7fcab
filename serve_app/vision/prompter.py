"""What the ingress needs of a vision model to make a prompt with images: its processor
(chat template, image preprocessing, image-token expansion) and the config facts mlx-vlm
reads."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

from mlx_worker.vision.image_inputs import ImageInputs
from mlx_worker.vision.prompt import vision_prompt
from mlx_worker.vision.vision_model import is_vision_checkpoint

from ..api.errors import ProtocolError
from .decode import ImageError, decode_images
from .image_args import ImageArgs


class VisionPrompter:
    def __init__(self, path: Path, args: ImageArgs):
        from mlx_vlm.utils import load_processor

        self.args = args
        self.config = SimpleNamespace(**json.loads((Path(path) / "config.json").read_text()))
        self.processor = load_processor(path, add_detokenizer=False)

    async def prompt(self, messages: List[Dict[str, Any]], template_kw: Dict[str, Any],
                     sources: List[str]) -> Tuple[List[int], ImageInputs]:
        """The prompt's ids and image inputs: the messages rendered by the model's own chat
        template (the processor's, else its tokenizer's), the images decoded within the
        limits and preprocessed, off the event loop."""
        return await asyncio.to_thread(self._prompt, messages, template_kw, sources)

    def _prompt(self, messages, template_kw, sources):
        images = decode_images(sources, self.args)
        p = self.processor
        render = p if getattr(p, "chat_template", None) else p.tokenizer
        try:
            text = render.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kw)
        except Exception as e:  # noqa: BLE001 - templates raise anything
            raise ProtocolError(f"chat template failed: {e}", "messages") from None
        try:
            return vision_prompt(p, self.config, text, images)
        except Exception as e:  # noqa: BLE001 - a processor that cannot take this image or prompt
            raise ImageError(f"the model's processor refused the images: {e}") from None


def vision_prompter(path: Path, args: ImageArgs):
    """A VisionPrompter for a vision checkpoint, None for a text model."""
    return VisionPrompter(path, args) if is_vision_checkpoint(str(path)) else None
