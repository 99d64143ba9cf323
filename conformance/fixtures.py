"""Fixture files: writing them from the catalog, reading them back as Calls.

Layout of ``conformance/fixtures/``:

- ``manifest.json``: ``{"format", "spec_version", "cases": [...]}``; each case
  has its name, function, module, tolerance class, note, seed, the
  ``kwargs`` skeleton (config values inline, each array replaced by
  ``{"$array": "<flat name>", "shape": [...], "dtype": "..."}``), ``wrt``,
  ``outputs``, ``error`` (``{"type", "arg", "message"}`` or null), and the
  ``file`` with its ``sha256``.
- one ``.npz`` per case (``/`` in the name becomes ``__``), keys
  ``in/<flat name>`` (inputs and params), ``cot/<output>``,
  ``out/<output>``, ``grad/<wrt name>`` and, for functions returning
  ``(out, weights)``, ``grad_out_only/<wrt name>`` (weights cotangent zero).

The zip entries carry a fixed timestamp, so regenerating identical arrays
gives identical bytes and an unchanged sha256.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np

from .protocol import Call, flatten, output_names

__all__ = [
    "FORMAT", "DEFAULT_DIR", "ManifestError", "FixtureError", "Fixture",
    "spec_version", "load_manifest", "load_fixture", "save_npz", "skeleton", "case_file",
    "write_fixture", "generate",
]

FORMAT = 1
DEFAULT_DIR = Path(__file__).parent / "fixtures"


class ManifestError(Exception):
    """The manifest as a whole cannot be used (unreadable, newer spec, ...)."""


class FixtureError(Exception):
    """One case's fixture cannot be used; the other cases still run."""


def spec_version() -> str:
    """The spec version this suite implements (``numpy_ref.SPEC_VERSION``)."""
    import numpy_ref

    return numpy_ref.SPEC_VERSION


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split("."))


def case_file(name: str) -> str:
    """``"mha/cross/padding"`` -> ``"mha__cross__padding.npz"``."""
    return name.replace("/", "__") + ".npz"


def save_npz(path: Path, arrays: dict) -> str:
    """Write ``arrays`` as a deterministic compressed ``.npz``; return its sha256."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            body = io.BytesIO()
            np.lib.format.write_array(body, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, body.getvalue())
    data = buffer.getvalue()
    Path(path).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def skeleton(tree, prefix: str = ""):
    """A JSON-able copy of ``kwargs`` with each array replaced by a reference."""
    if isinstance(tree, dict):
        return {k: skeleton(v, f"{prefix}.{k}" if prefix else k) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [skeleton(v, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(tree)]
    if isinstance(tree, np.ndarray):
        return {"$array": prefix, "shape": list(tree.shape), "dtype": tree.dtype.name}
    if isinstance(tree, np.generic):
        return tree.item()
    return tree


def _rebuild(node, arrays, name):
    if isinstance(node, dict) and "$array" in node:
        key = "in/" + node["$array"]
        if key not in arrays:
            raise FixtureError(f"{name}: fixture file has no array {key!r}")
        a = arrays[key]
        if list(a.shape) != node["shape"] or a.dtype.name != node["dtype"]:
            raise FixtureError(
                f"{name}: array {key!r} is {a.dtype.name}{list(a.shape)}, "
                f"the manifest says {node['dtype']}{node['shape']}"
            )
        return a
    if isinstance(node, dict):
        return {k: _rebuild(v, arrays, name) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, arrays, name) for v in node]
    return node


def load_manifest(directory: Path | str = DEFAULT_DIR) -> dict:
    """Read and vet ``manifest.json``.

    Raises:
      ManifestError: missing or unreadable file, unknown format, or a spec
        version newer than this suite's (old suites must not certify new rules).
    """
    path = Path(directory) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest; run `python -m conformance generate`") from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("cases"), list):
        raise ManifestError(f"{path}: malformed manifest (no 'cases' list)")
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{path}: fixture format {manifest.get('format')!r}, this suite reads {FORMAT}")
    try:
        theirs = _version_tuple(manifest.get("spec_version"))
    except (TypeError, ValueError):
        raise ManifestError(f"{path}: malformed spec_version {manifest.get('spec_version')!r}") from None
    ours = spec_version()
    if theirs > _version_tuple(ours):
        raise ManifestError(
            f"{path}: fixtures are for spec {manifest['spec_version']}, newer than the spec "
            f"{ours} this suite implements; update the conformance package (or regenerate)"
        )
    return manifest


@dataclasses.dataclass
class Fixture:
    """One case as read back: the Call and what it must produce."""

    name: str
    component: str
    tolerance: str
    call: Call
    error_arg: str | None = None
    outputs: dict = dataclasses.field(default_factory=dict)
    grads: dict = dataclasses.field(default_factory=dict)
    grads_out_only: dict = dataclasses.field(default_factory=dict)


def load_fixture(entry: dict, directory: Path | str = DEFAULT_DIR) -> Fixture:
    """The :class:`Fixture` of one manifest entry.

    Raises:
      FixtureError: missing file, sha256 mismatch, unreadable ``.npz``, or an
        array missing or of the wrong shape/dtype.
    """
    name = entry.get("name", "<unnamed>")
    try:
        path = Path(directory) / entry["file"]
        data = path.read_bytes()
    except KeyError as exc:
        raise FixtureError(f"{name}: manifest entry lacks {exc}") from None
    except OSError as exc:
        raise FixtureError(f"{name}: cannot read fixture file ({exc.strerror}: {path.name})") from None
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise FixtureError(f"{name}: {path.name} does not match its sha256 in the manifest (corrupt or edited)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:
        raise FixtureError(f"{name}: {path.name} is not a readable .npz ({type(exc).__name__}: {exc})") from None

    try:
        function = entry["function"]
        kwargs = _rebuild(entry["kwargs"], arrays, name)
        error = entry.get("error")
        if error:
            call = Call(name, function, entry["module"], kwargs, expect_error=error["type"])
            return Fixture(name, entry["component"], entry["tolerance"], call, error_arg=error["arg"])

        def section(prefix, names):
            missing = [n for n in names if f"{prefix}/{n}" not in arrays]
            if missing:
                raise FixtureError(f"{name}: fixture file has no {prefix}/ entries for {missing}")
            return {n: arrays[f"{prefix}/{n}"] for n in names}

        wrt = tuple(entry["wrt"])
        outs = tuple(entry["outputs"])
        cotangents = section("cot", outs) if wrt else {}
        call = Call(name, function, entry["module"], kwargs, wrt, cotangents)
        return Fixture(
            name, entry["component"], entry["tolerance"], call,
            outputs=section("out", outs),
            grads=section("grad", wrt),
            grads_out_only=section("grad_out_only", wrt) if wrt and len(outs) > 1 else {},
        )
    except KeyError as exc:
        raise FixtureError(f"{name}: manifest entry lacks {exc}") from None


def write_fixture(case, directory: Path) -> dict:
    """Run ``case`` through numpy_ref in float64, write its ``.npz``; the manifest entry.

    Raises:
      RuntimeError: numpy_ref does not behave as the case says (an error case
        that does not raise, a wrong message, a missing gradient).
    """
    from .invoke import numpy_backward, numpy_forward

    call = case.call()
    entry = {
        "name": case.name,
        "component": case.name.split("/", 1)[0],
        "function": case.function,
        "module": case.module,
        "tolerance": case.tolerance,
        "note": case.note,
        "seed": case.seed,
        "kwargs": skeleton(call.kwargs),
        "wrt": list(call.wrt),
        "outputs": list(output_names(case.function)),
        "error": None,
    }
    arrays = {"in/" + k: v for k, v in flatten(call.kwargs).items() if isinstance(v, np.ndarray)}
    if case.error is not None:
        exc_type, arg = case.error
        try:
            numpy_forward(case.function, call.kwargs)
        except Exception as exc:  # compared below
            if type(exc).__name__ != exc_type or not str(exc).startswith(arg):
                raise RuntimeError(
                    f"{case.name}: numpy_ref raised {type(exc).__name__}({str(exc)!r}), "
                    f"the case expects {exc_type} starting with {arg!r}"
                ) from exc
            entry["error"] = {"type": exc_type, "arg": arg, "message": str(exc)}
        else:
            raise RuntimeError(f"{case.name}: numpy_ref raised nothing, the case expects {exc_type}")
    else:
        outputs = numpy_forward(case.function, call.kwargs)
        arrays.update({"out/" + k: np.asarray(v) for k, v in outputs.items()})
        if call.wrt:
            arrays.update({"cot/" + k: v for k, v in call.cotangents.items()})
            sections = {"grad": call.cotangents}
            if len(entry["outputs"]) > 1:
                sections["grad_out_only"] = {"out": call.cotangents["out"]}
            for prefix, cotangents in sections.items():
                grads = numpy_backward(call, call.kwargs, cotangents)
                missing = [n for n in call.wrt if n not in grads]
                if missing:
                    raise RuntimeError(f"{case.name}: numpy_ref backward gave no gradient for {missing}")
                arrays.update({f"{prefix}/{n}": np.asarray(grads[n]) for n in call.wrt})
    entry["file"] = case_file(case.name)
    entry["sha256"] = save_npz(Path(directory) / entry["file"], arrays)
    return entry


def generate(directory: Path | str = DEFAULT_DIR, cases=None) -> dict:
    """Write every case's fixture and the manifest into ``directory``; the manifest."""
    from .cases import CASES

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries, problems = [], []
    for case in CASES if cases is None else cases:
        try:
            entries.append(write_fixture(case, directory))
        except Exception as exc:  # report every broken case, not just the first
            problems.append(f"{case.name}: {type(exc).__name__}: {exc}")
    if problems:
        raise RuntimeError("fixture generation failed:\n  " + "\n  ".join(problems))
    if cases is None:  # a full run owns the directory: drop files of removed cases
        keep = {e["file"] for e in entries}
        for stale in directory.glob("*.npz"):
            if stale.name not in keep:
                os.remove(stale)
    manifest = {"format": FORMAT, "spec_version": spec_version(), "cases": entries}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
