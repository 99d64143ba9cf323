"""numpy_ref: the executable specification of Transformer attention.

Pure numpy, float64-exact, with a hand-derived ``*_backward`` for every
differentiable function. See ``docs/API.md`` for the calling contract and
``../shared/SPEC.md`` (summarised in the README) for the semantics.
"""
from .masks import *  # noqa: F401,F403
from .positional import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .encoder import *  # noqa: F401,F403

SPEC_VERSION = "1.0"
