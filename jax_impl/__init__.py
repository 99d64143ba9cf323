"""jax_impl: the JAX mirror of numpy_ref (pure, jit-compatible functions).

Same files, same function names, same semantics as ``numpy_ref``; gradients
come from ``jax.vjp``. Parameters are pytrees of nested dicts. Float64 needs
``jax.config.update("jax_enable_x64", True)``, which this package never sets
itself. Requires ``jax`` (``pip install attention-spec[jax]``).
"""
import sys as _sys

try:
    import jax as _framework  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name not in ("jax", "jaxlib"):
        raise
    if _sys.argv[:1] != ["-m"]:
        raise ModuleNotFoundError(
            f"jax_impl needs JAX, which is not installed ({_exc}): pip install "
            '"attention-spec[jax]"',
            name=_exc.name,
        ) from None
    # ``python -m jax_impl`` is locating its __main__ (sys.argv[0] is "-m" until
    # then): let the package import empty, so that __main__ can print its usage
    # or say in one line what to install, instead of a traceback from here.
else:
    from .masks import *  # noqa: F401,F403
    from .positional import *  # noqa: F401,F403
    from .attention import *  # noqa: F401,F403
    from .variants import *  # noqa: F401,F403
    from .blockwise import *  # noqa: F401,F403
    from .sharded import *  # noqa: F401,F403
    from .ulysses import *  # noqa: F401,F403
    from .layers import *  # noqa: F401,F403
    from .encoder import *  # noqa: F401,F403
    from .seq2seq import *  # noqa: F401,F403
    from .decoder import *  # noqa: F401,F403
    from .cache import *  # noqa: F401,F403
    from .sharded_cache import *  # noqa: F401,F403
    from .transformer import *  # noqa: F401,F403
