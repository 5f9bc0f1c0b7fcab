"""The HTTP surface in one namespace: each API lives in its own module (chat,
completions, ...) around what they share (openai_common, errors)."""

from .chat import *  # noqa: F401,F403
from .completions import *  # noqa: F401,F403
from .errors import *  # noqa: F401,F403
from .openai_common import *  # noqa: F401,F403
from .openai_common import _Request  # noqa: F401
