"""Backend registry: the built-in adapters and loading third-party ones.

A backend is named either by a built-in name (``numpy``, ``torch``,
``torch-fused``, ``jax``) or by ``"package.module:ClassName"``; the class must
subclass :class:`conformance.protocol.Backend`. A backend whose module or
``requires`` cannot be imported is *unavailable*, with a one-line reason.
"""
from __future__ import annotations

import importlib

from ..protocol import Backend

__all__ = ["BUILTINS", "Unavailable", "load", "load_class", "declaration_problem"]

BUILTINS = {
    "numpy": "conformance.backends.numpy_backend:NumpyBackend",
    "torch": "conformance.backends.torch_backend:TorchBackend",
    "torch-fused": "conformance.backends.torch_backend:TorchFusedBackend",
    "jax": "conformance.backends.jax_backend:JaxBackend",
}


class Unavailable(Exception):
    """The backend cannot run here; ``str(exc)`` is the one-line reason."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_class(spec: str) -> type[Backend]:
    """The Backend subclass named by a built-in name or ``"module:Class"``.

    Raises:
      Unavailable: with a one-line reason (unknown name, import failure,
        missing class, not a Backend, or a missing ``requires`` module).
    """
    target = BUILTINS.get(spec, spec)
    if ":" not in target:
        raise Unavailable(
            f"unknown backend {spec!r}: expected one of {sorted(BUILTINS)} or 'package.module:ClassName'"
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an adapter may fail to import for any reason
        raise Unavailable(f"cannot import {module_name} ({_one_line(exc)})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise Unavailable(f"module {module_name} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise Unavailable(f"{target} is not a subclass of conformance.protocol.Backend")
    problem = declaration_problem(cls)
    if problem:
        raise Unavailable(f"{target}: {problem}")
    for requirement in cls.requires:
        try:
            importlib.import_module(requirement)
        except Exception as exc:
            raise Unavailable(f"requires {requirement} ({_one_line(exc)})") from None
    return cls


DTYPES = ("float64", "float32", "bfloat16", "float16")


def declaration_problem(cls) -> str | None:
    """What is wrong with a Backend class's declared capabilities, or None."""
    name, dtypes, devices = cls.name, cls.dtypes, cls.devices
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        return f"name must be a non-empty string without spaces, got {name!r}"
    if isinstance(dtypes, str) or not dtypes or any(d not in DTYPES for d in dtypes):
        return f"dtypes must be a non-empty tuple from {DTYPES}, got {dtypes!r}"
    for attr in ("gradients", "errors"):
        if not isinstance(getattr(cls, attr), bool):
            return f"{attr} must be True or False, got {getattr(cls, attr)!r}"
    if devices is not None and (isinstance(devices, str) or not all(isinstance(d, str) for d in devices)):
        return f"devices must be None or a tuple of platform names, got {devices!r}"
    if isinstance(cls.requires, str):
        return f"requires must be a tuple of module names, got the string {cls.requires!r}"
    return None


def load(spec: str) -> Backend:
    """An instance of the backend named by ``spec`` (see :func:`load_class`)."""
    cls = load_class(spec)
    try:
        return cls()
    except Exception as exc:
        raise Unavailable(f"{spec}: constructor raised {_one_line(exc)}") from None
