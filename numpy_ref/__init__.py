"""numpy_ref: the executable specification of Transformer attention.

Pure numpy, float64-exact, with a hand-derived ``*_backward`` for every
differentiable function. The semantics are ``docs/SPEC.md`` (its version line
is ``SPEC_VERSION``), the calling contract ``docs/API.md``, both in the
repository.
"""
from .masks import *  # noqa: F401,F403
from .positional import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .variants import *  # noqa: F401,F403
from .blockwise import *  # noqa: F401,F403
from .sharded import *  # noqa: F401,F403
from .ulysses import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .encoder import *  # noqa: F401,F403
from .decoder import *  # noqa: F401,F403
from .cache import *  # noqa: F401,F403
from .sharded_cache import *  # noqa: F401,F403
from .seq2seq import *  # noqa: F401,F403
from .transformer import *  # noqa: F401,F403

SPEC_VERSION = "1.6"
