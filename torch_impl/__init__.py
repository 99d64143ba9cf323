"""torch_impl: the PyTorch mirror of numpy_ref (functions and nn.Modules).

Same files, same function names, same semantics as ``numpy_ref``; gradients
come from autograd. Requires ``torch`` (``pip install attention-spec[torch]``).
"""
from .masks import *  # noqa: F401,F403
from .positional import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .encoder import *  # noqa: F401,F403
