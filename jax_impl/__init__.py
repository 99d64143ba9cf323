"""jax_impl: the JAX mirror of numpy_ref (pure, jit-compatible functions).

Same files, same function names, same semantics as ``numpy_ref``; gradients
come from ``jax.vjp``. Parameters are pytrees of nested dicts. Float64 needs
``jax.config.update("jax_enable_x64", True)``, which this package never sets
itself. Requires ``jax`` (``pip install attention-spec[jax]``).
"""
from .masks import *  # noqa: F401,F403
from .positional import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .encoder import *  # noqa: F401,F403
