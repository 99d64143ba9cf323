"""Backend registry: the built-in adapters and loading third-party ones.

A backend is named either by a built-in name (``numpy``, ``torch``,
``torch-fused``, ``jax``), a peer's name (``torch-sdpa``, ``torch-mha``,
``torch-encoder-layer``, ``jax-dpa``, ``onnx-attention``: the frameworks' own
built-ins, see ``conformance.backends.peers`` and ``conformance.backends.onnx_peer``;
not run by default) or by ``"package.module:ClassName"``; the class must subclass
:class:`conformance.protocol.Backend`. A backend whose module or
``requires`` cannot be imported, or whose declarations (dtypes, devices,
differences, ...) are malformed, is *unavailable*, with a one-line reason.
"""
from __future__ import annotations

import importlib

from ..protocol import Backend
from ..vocabulary import DTYPES

__all__ = ["BUILTINS", "PEERS", "Unavailable", "load", "load_class", "declaration_problem"]

BUILTINS = {
    "numpy": "conformance.backends.numpy_backend:NumpyBackend",
    "torch": "conformance.backends.torch_backend:TorchBackend",
    "torch-fused": "conformance.backends.torch_backend:TorchFusedBackend",
    "jax": "conformance.backends.jax_backend:JaxBackend",
}

#: the frameworks' own built-ins as backends (``python -m conformance peers``);
#: loadable by name like a built-in, but not in the default run
PEERS = {
    "torch-sdpa": "conformance.backends.peers:TorchSdpaPeer",
    "torch-mha": "conformance.backends.peers:TorchMhaPeer",
    "torch-encoder-layer": "conformance.backends.peers:TorchEncoderLayerPeer",
    "torch-decoder-layer": "conformance.backends.peers:TorchDecoderLayerPeer",
    "torch-decoder": "conformance.backends.peers:TorchDecoderPeer",
    "jax-dpa": "conformance.backends.peers:JaxDpaPeer",
    "onnx-attention": "conformance.backends.onnx_peer:OnnxAttentionPeer",
    "torch-flex": "conformance.backends.peers:TorchFlexPeer",
    # the libraries' layers (issue 27): Hugging Face transformers, Flax NNX, Keras 3, Equinox, ONNX Runtime
    "hf-llama-eager": "conformance.backends.hf_peers:HfLlamaEagerPeer",
    "hf-llama-sdpa": "conformance.backends.hf_peers:HfLlamaSdpaPeer",
    "hf-qwen2-eager": "conformance.backends.hf_peers:HfQwen2EagerPeer",
    "hf-qwen2-sdpa": "conformance.backends.hf_peers:HfQwen2SdpaPeer",
    "hf-gemma2-eager": "conformance.backends.hf_peers:HfGemma2EagerPeer",
    "hf-gemma2-sdpa": "conformance.backends.hf_peers:HfGemma2SdpaPeer",
    "hf-bert-eager": "conformance.backends.hf_peers:HfBertEagerPeer",
    "hf-bert-sdpa": "conformance.backends.hf_peers:HfBertSdpaPeer",
    "hf-llama-dynamic-cache": "conformance.backends.hf_peers:HfLlamaDynamicCachePeer",
    "hf-llama-static-cache": "conformance.backends.hf_peers:HfLlamaStaticCachePeer",
    "hf-llama-flex": "conformance.backends.hf_peers:HfLlamaFlexPeer",
    "flax-nnx-mha": "conformance.backends.jax_library_peers:FlaxNnxMhaPeer",
    "flax-nnx-decode": "conformance.backends.jax_library_peers:FlaxNnxDecodePeer",
    "flax-nnx-dpa": "conformance.backends.jax_library_peers:FlaxNnxDpaPeer",
    "keras-mha": "conformance.backends.jax_library_peers:KerasMhaPeer",
    "equinox-mha": "conformance.backends.jax_library_peers:EquinoxMhaPeer",
    "ort-attention": "conformance.backends.ort_peers:OrtAttentionPeer",
    "ort-contrib-mha": "conformance.backends.ort_peers:OrtMhaPeer",
    "ort-contrib-gqa": "conformance.backends.ort_peers:OrtGqaPeer",
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
    target = BUILTINS.get(spec) or PEERS.get(spec, spec)
    if ":" not in target:
        raise Unavailable(
            f"unknown backend {spec!r}: expected one of {sorted(BUILTINS) + sorted(PEERS)} "
            "or 'package.module:ClassName'"
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
    return differences_problem(cls)


def differences_problem(cls) -> str | None:
    """What is wrong with a Backend class's ``differences``, or None (see ``protocol.Difference``)."""
    from fnmatch import fnmatchcase

    from ..protocol import CHECK_ALIASES, Difference
    from ..vocabulary import OUTPUTS
    from ..select import parse_select

    diffs = getattr(cls, "differences", ())
    if isinstance(diffs, (str, Difference)) or not isinstance(diffs, (tuple, list)):
        return f"differences must be a tuple of conformance.protocol.Difference, got {diffs!r}"
    outputs = {n for names in OUTPUTS.values() for n in names} | {"out"}
    seen = set()
    for i, d in enumerate(diffs):
        where = f"differences[{i}]"
        if not isinstance(d, Difference):
            return f"{where} must be a conformance.protocol.Difference, got {type(d).__name__}"
        if not isinstance(d.name, str) or not d.name.strip() or any(c.isspace() for c in d.name):
            return f"{where}.name must be a non-empty string without spaces, got {d.name!r}"
        where = f"difference {d.name!r}"
        if d.name in seen:
            return f"{where} is declared twice"
        seen.add(d.name)
        if not isinstance(d.summary, str) or not d.summary.strip() or "\n" in d.summary:
            return f"{where}: summary must be one non-empty line, got {d.summary!r}"
        if not isinstance(d.cases, str):
            return f"{where}: cases must be a -k expression (a string), got {d.cases!r}"
        try:
            parse_select(d.cases)
        except ValueError as exc:
            return f"{where}: cases {exc}"
        if isinstance(d.checks, str) or not isinstance(d.checks, (tuple, list)) or not d.checks:
            return (f"{where}: checks must be a non-empty tuple of 'all', 'outputs', 'gradients', "
                    f"'output:<name>' or 'grad:<name>', got {d.checks!r}")
        for check in d.checks:
            kind, _, pattern = check.partition(":") if isinstance(check, str) else ("", "", "")
            if check in CHECK_ALIASES:
                continue
            if kind not in ("output", "grad") or not pattern:
                return (f"{where}: check {check!r} is none of 'all', 'outputs', 'gradients', "
                        "'output:<name>', 'grad:<name>'")
            if kind == "output" and not any(fnmatchcase(n, pattern) for n in outputs):
                return f"{where}: check {check!r} names no output (outputs: {', '.join(sorted(outputs))})"
        if not cls.gradients and all(p.startswith("grad:") for p in d.check_patterns()):
            return f"{where}: names only gradient checks, but the backend declares gradients = False"
        if d.dtypes is not None and (isinstance(d.dtypes, str) or not isinstance(d.dtypes, (tuple, list))
                                     or not d.dtypes or any(t not in cls.dtypes for t in d.dtypes)):
            return (f"{where}: dtypes must be None or a non-empty tuple of the backend's dtypes "
                    f"({', '.join(cls.dtypes)}), got {d.dtypes!r}")
    return None


def load(spec: str) -> Backend:
    """An instance of the backend named by ``spec`` (see :func:`load_class`)."""
    cls = load_class(spec)
    try:
        return cls()
    except Exception as exc:
        raise Unavailable(f"{spec}: constructor raised {_one_line(exc)}") from None
