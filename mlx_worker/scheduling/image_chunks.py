"""How a vision prompt's images shape its prefill chunks (the scheduler asks).

- Its images go through the vision tower in the step of its first chunk that shows one
  (all those the image cache lacks: `tower_tokens`). The step budget prices the tower,
  and a step that encodes images already takes another prompt's only within its gap;
  else that prompt's text up to its first image.
- Where the model's image tokens attend to each other both ways (Gemma 4's larger
  checkpoints: `ImageInputs.blocks`), a chunk ends before an image's tokens or after
  them, never inside, so that the chunk's tokens of an image see all of its keys (an
  image that begins the chunk is taken whole, past the step's room). Such a prompt is
  admitted only with pages for all of its tokens: two prompts that each held part of
  theirs could both wait at an image for pages the other holds.
"""

from typing import Callable, Optional, Tuple

from ..request import Sequence
from .step_budget import StepRoom


class ImageChunks:
    def __init__(self, tower_tokens: Optional[Callable] = None):
        self.tower_tokens = tower_tokens  # a vision model's: image tokens of a prompt's images its tower would encode

    def tower(self, seq: Sequence, start: int, wanted: int, room: StepRoom) -> Tuple[int, int]:
        """(tokens the chunk may want, image tokens the tower encodes if the chunk shows an
        image): its images are encoded with its first chunk that shows one."""
        if self.tower_tokens is None or seq.images is None or seq.embeds is not None:
            return wanted, 0
        tower = self.tower_tokens(seq.images)
        if tower and not room.tower_fits(tower):
            return min(wanted, seq.images.spans[0][0] - start), 0
        return wanted, tower

    @staticmethod
    def encoded(seq: Sequence, start: int, length: int, tower: int) -> int:
        """The image tokens a chunk of `length` makes the tower encode (0 if it shows none)."""
        return tower if tower and seq.images.shown(start, start + length) else 0

    @staticmethod
    def holds_all_pages(seq: Sequence) -> bool:
        """Whether it is admitted only with pages for all of its tokens."""
        return seq.images is not None and bool(seq.images.blocks)

    @staticmethod
    def end_outside_blocks(seq: Sequence, start: int, length: int) -> int:
        """The chunk's length, ending before or after each image block, never inside."""
        for s, t in (seq.images.blocks or ()) if seq.images is not None else ():
            if s < start + length < t:
                return s - start if s > start else t - start
        return length
