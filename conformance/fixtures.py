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

Reading is defensive: a fixture folder may come from anywhere (a pull
request, a download), so every manifest entry is validated field by field,
its ``file`` must be a plain file name inside the folder (no separator, no
symlink, no device, at most :data:`MAX_FILE_BYTES`), and each ``.npz``
member's ``.npy`` header is checked against the manifest before any array
data is read. Whatever is wrong becomes a one-line :class:`FixtureError` for
that case.

Writing (:func:`generate`) only touches a folder it owns (empty, or holding a
manifest of ours), only removes ``.npz`` files the previous manifest listed,
and keeps an existing file whose arrays agree with the fresh ones within
:data:`NOISE_RTOL`, so regenerating on another machine does not churn the
committed fixtures with rounding noise.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import re
import secrets
import stat
import zipfile
from pathlib import Path

import numpy as np

from .protocol import Call, flatten, output_names

__all__ = [
    "FORMAT", "DEFAULT_DIR", "MAX_FILE_BYTES", "MAX_ARRAY_BYTES", "NOISE_RTOL",
    "ManifestError", "FixtureError", "FolderError", "Fixture", "GenerateReport",
    "spec_version", "load_manifest", "load_fixture", "save_npz", "skeleton", "case_file",
    "build_fixture", "write_fixture", "within_noise_floor", "generate",
]

FORMAT = 1
DEFAULT_DIR = Path(__file__).parent / "fixtures"

#: Largest fixture or manifest file read, in bytes. The committed files are
#: at most 64 KiB (the manifest ~0.3 MiB); the cap is there so that a hostile
#: or broken folder cannot make the loader read without bound.
MAX_FILE_BYTES = 64 * 2**20
#: Largest total uncompressed size of one case's arrays, from the ``.npy``
#: headers, checked before decompressing (a zip bomb is refused unread).
MAX_ARRAY_BYTES = 64 * 2**20

#: Noise floor of :func:`generate`: an existing output or gradient array is
#: kept when ``max|new - old| <= NOISE_RTOL * max(1, max|old|)`` over its
#: finite elements (non-finite ones must match exactly; inputs, cotangents
#: and bool/int arrays bit for bit). Measured: the committed float64 fixtures
#: (OpenBLAS SkylakeX kernels) regenerated with the Haswell, Sandybridge and
#: Prescott kernels (``OPENBLAS_CORETYPE``, other summation orders) differ in
#: up to 61 files by at most 2.9e-15 of that scale (0.0029 of the floor;
#: worst: ``encoder/post/final-norm`` ``grad/params.layers.0.self_attn.b_q``).
#: The scale is floored at 1 because some gradients are analytically zero (a
#: key bias under softmax) and hold pure rounding noise (~1e-16) of O(1)
#: terms; the catalog's inputs are O(1). 1e-12 leaves a 340x margin and is
#: 10^4 below any change of semantics, which moves results by >= 1e-8.
NOISE_RTOL = 1e-12

#: case names: ``component/variant[/...]``, lower case, as in the catalog
_NAME = re.compile(r"[a-z][a-z0-9_]*(/[a-z0-9][a-z0-9_.+-]*)+")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FLAT = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\.npz")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_NAME = 200
#: dtypes an input array may have; no object, string, structured or void dtype
_IN_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
})
_FLOATS = frozenset({"float16", "float32", "float64"})


class ManifestError(Exception):
    """The manifest as a whole cannot be used (unreadable, newer spec, ...)."""


class FixtureError(Exception):
    """One case's fixture cannot be used; the other cases still run."""


class FolderError(RuntimeError):
    """:func:`generate` refuses a folder it does not own; nothing was written."""


class _Refused(Exception):
    """A file the safe reader will not read (symlink, device, too large)."""


class _Invalid(dict):
    """A manifest entry that :func:`load_manifest` found unusable.

    A dict with a printable ``name`` (so that callers iterating the cases can
    name it) whose :func:`load_fixture` raises ``FixtureError(problem)``.
    """

    def __init__(self, name: str, problem: str):
        super().__init__(name=name)
        self.problem = problem


def spec_version() -> str:
    """The spec version this suite implements (``numpy_ref.SPEC_VERSION``)."""
    import numpy_ref

    return numpy_ref.SPEC_VERSION


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split("."))


def case_file(name: str) -> str:
    """``"mha/cross/padding"`` -> ``"mha__cross__padding.npz"``."""
    return name.replace("/", "__") + ".npz"


def _npz_bytes(arrays: dict) -> bytes:
    """The deterministic compressed ``.npz`` of ``arrays`` (sorted keys, fixed timestamp)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            body = io.BytesIO()
            np.lib.format.write_array(body, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, body.getvalue())
    return buffer.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    A reader never sees half a file, and a symlink at ``path`` is replaced,
    not followed (the rename replaces the link itself).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide the mode, as write_bytes would
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def save_npz(path: Path, arrays: dict) -> str:
    """Write ``arrays`` as a deterministic compressed ``.npz``; return its sha256."""
    data = _npz_bytes(arrays)
    _write_atomic(Path(path), data)
    return hashlib.sha256(data).hexdigest()


def _read_capped(path: Path) -> bytes:
    """The bytes of a regular file of at most :data:`MAX_FILE_BYTES`.

    Raises:
      FileNotFoundError / OSError: as ``open`` does.
      _Refused: a symlink (it could point anywhere, e.g. ``/dev/zero``), a
        device, FIFO or directory, or a file over the cap.
    """
    cap = MAX_FILE_BYTES
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _Refused("is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _Refused("is not a regular file")
    if st.st_size > cap:
        raise _Refused(f"is {st.st_size} bytes, over the {cap}-byte cap")
    # O_NOFOLLOW and fstat close the window between lstat and open; O_NONBLOCK
    # keeps a FIFO swapped in meanwhile from blocking the open
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _Refused("is not a regular file")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise _Refused(f"is over the {cap}-byte cap")
    return data


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


def _rebuild(node, arrays):
    """``kwargs`` from its skeleton; the arrays were checked against it already."""
    if isinstance(node, dict) and "$array" in node:
        return arrays["in/" + node["$array"]]
    if isinstance(node, dict):
        return {k: _rebuild(v, arrays) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, arrays) for v in node]
    return node


# --------------------------------------------------------------------------
# validating manifest entries


class _Bad(Exception):
    """A field of a manifest entry is wrong: ``_Bad(field, problem)``."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"manifest field {field!r} {problem}")


def _kind(value) -> str:
    """The JSON kind of ``value``, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _string(entry: dict, field: str, pattern: re.Pattern | None = None, what: str = "") -> str:
    if field not in entry:
        raise _Bad(field, "is missing")
    value = entry[field]
    if not isinstance(value, str):
        raise _Bad(field, f"must be a string, got {_kind(value)}")
    if pattern is not None and (len(value) > _MAX_NAME or not pattern.fullmatch(value)):
        raise _Bad(field, f"must be {what}, got {value[:80]!r}")
    return value


def _string_list(entry: dict, field: str, pattern: re.Pattern, what: str) -> list:
    if field not in entry:
        raise _Bad(field, "is missing")
    value = entry[field]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Bad(field, f"must be a list of strings, got {_kind(value)}")
    bad = [v for v in value if len(v) > _MAX_NAME or not pattern.fullmatch(v)]
    if bad:
        raise _Bad(field, f"must hold {what}, got {bad[0][:80]!r}")
    if len(set(value)) != len(value):
        raise _Bad(field, "has duplicates")
    return value


def _array_refs(node, path: str, refs: dict, depth: int = 0) -> None:
    """Collect ``{flat name: (shape, dtype name)}`` from a kwargs skeleton."""
    if depth > 32:
        raise _Bad("kwargs", "is nested too deeply")
    if isinstance(node, dict) and "$array" in node:
        where = f"at {path or '<top>'!r}"
        if set(node) != {"$array", "shape", "dtype"}:
            raise _Bad("kwargs", f"array reference {where} must have exactly $array, shape, dtype")
        ref, shape, dtype = node["$array"], node["shape"], node["dtype"]
        if ref != path or not _FLAT.fullmatch(path):
            raise _Bad("kwargs", f"array reference {where} is named {str(ref)[:80]!r}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 32:
            raise _Bad("kwargs", f"array {path!r} has a malformed shape {str(shape)[:80]}")
        if dtype not in _IN_DTYPES:
            raise _Bad("kwargs", f"array {path!r} has dtype {str(dtype)[:40]!r}, not one of bool/int/uint/float")
        refs[path] = (tuple(shape), dtype)
    elif isinstance(node, dict):
        for key, value in node.items():
            _array_refs(value, f"{path}.{key}" if path else key, refs, depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _array_refs(value, f"{path}.{i}" if path else str(i), refs, depth + 1)


def _check_file_name(entry: dict) -> str:
    value = _string(entry, "file")
    if "/" in value or "\\" in value or os.sep in value or (os.altsep and os.altsep in value):
        raise _Bad("file", f"must be a bare file name, got a path {value[:80]!r}")
    if os.path.isabs(value) or value in (".", "..") or value.startswith(".."):
        raise _Bad("file", f"must be a bare file name, got {value[:80]!r}")
    if len(value) > _MAX_NAME or not _FILE.fullmatch(value):
        raise _Bad("file", f"must be a .npz name of letters, digits and _.+-, got {value[:80]!r}")
    return value


def _validate(entry) -> tuple[dict, list]:
    """Check every field of one manifest entry.

    Returns:
      ``(refs, wrt)``: the input arrays ``{flat name: (shape, dtype)}`` and
      the names to differentiate.

    Raises:
      _Bad: naming the first wrong field.
    """
    from .tolerances import CLASSES

    name = _string(entry, "name", _NAME, "a case name like 'component/variant' (a-z 0-9 _ . + -)")
    component = _string(entry, "component")
    if component != name.split("/", 1)[0]:
        raise _Bad("component", f"is {component[:80]!r}, the name says {name.split('/', 1)[0]!r}")
    _string(entry, "function", _IDENT, "a Python identifier")
    _string(entry, "module", _IDENT, "a Python identifier")
    tolerance = _string(entry, "tolerance")
    if tolerance not in CLASSES:
        raise _Bad("tolerance", f"is {tolerance[:80]!r}, not a class of conformance.tolerances ({', '.join(CLASSES)})")
    if "note" in entry and not isinstance(entry["note"], str):
        raise _Bad("note", f"must be a string, got {_kind(entry['note'])}")
    if "seed" in entry and type(entry["seed"]) is not int:
        raise _Bad("seed", f"must be an integer, got {_kind(entry['seed'])}")
    if "kwargs" not in entry:
        raise _Bad("kwargs", "is missing")
    if not isinstance(entry["kwargs"], dict):
        raise _Bad("kwargs", f"must be an object, got {_kind(entry['kwargs'])}")
    refs: dict = {}
    _array_refs(entry["kwargs"], "", refs)
    total = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in refs.values())
    if total > MAX_ARRAY_BYTES:
        raise _Bad("kwargs", f"arrays total {total} bytes, over the {MAX_ARRAY_BYTES}-byte cap")
    outputs = _string_list(entry, "outputs", _IDENT, "output names (identifiers)")
    if not outputs:
        raise _Bad("outputs", "is empty")
    wrt = _string_list(entry, "wrt", _FLAT, "flat input names")
    unknown = [w for w in wrt if w not in refs]
    if unknown:
        raise _Bad("wrt", f"names {unknown[0][:80]!r}, which is not an array of kwargs")
    not_float = [w for w in wrt if refs[w][1] not in _FLOATS]
    if not_float:
        raise _Bad("wrt", f"names {not_float[0][:80]!r}, which is not a float array")
    if "error" not in entry:
        raise _Bad("error", "is missing")
    error = entry["error"]
    if error is not None:
        if not isinstance(error, dict):
            raise _Bad("error", f"must be an object or null, got {_kind(error)}")
        for key in ("type", "arg", "message"):
            if not isinstance(error.get(key), str):
                raise _Bad("error", f"must have a string {key!r}, got {_kind(error.get(key))}")
        if not _IDENT.fullmatch(error["type"]):
            raise _Bad("error", f"type must be an exception name, got {error['type'][:80]!r}")
        if wrt:
            raise _Bad("wrt", "must be empty for an error case")
    _check_file_name(entry)
    _string(entry, "sha256", _SHA256, "64 lower-case hex digits")
    return refs, wrt


def _members(entry: dict, refs: dict, wrt: list) -> dict:
    """``{key: (shape or None, allowed dtype names, shape-as key or None)}`` of one case's ``.npz``."""
    expected = {f"in/{n}": (shape, frozenset({dtype}), None) for n, (shape, dtype) in refs.items()}
    if entry["error"] is not None:
        return expected
    outputs = entry["outputs"]
    for o in outputs:
        expected[f"out/{o}"] = (None, _FLOATS | {"bool"}, None)
        if wrt:
            expected[f"cot/{o}"] = (None, _FLOATS, f"out/{o}")
    sections = ("grad", "grad_out_only") if wrt and len(outputs) > 1 else ("grad",)
    for prefix in sections:
        for n in wrt:
            expected[f"{prefix}/{n}"] = (refs[n][0], _FLOATS, None)
    return expected


def _read_npz(data: bytes, expected: dict, where: str) -> dict:
    """The arrays of an ``.npz``, after checking it against ``expected``.

    The member list and each member's ``.npy`` header (shape, dtype, declared
    size) are checked first; array data is read only when all agree, with
    ``allow_pickle=False``.

    Args:
      data: the file's bytes.
      expected: from :func:`_members`, or ``{key: (shape, {dtype}, None)}``.
      where: the message prefix, ``"<case>: <file>"``.

    Raises:
      FixtureError: naming the member and what is wrong.
    """
    def bad(problem):
        return FixtureError(f"{where}: {problem}")

    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except Exception as exc:
        raise bad(f"not a readable .npz ({type(exc).__name__}: {exc})") from None
    with zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            raise bad("not a readable .npz (duplicate members)")
        keys = {n[:-4]: i for n, i in zip(names, infos) if n.endswith(".npy")}
        extra = sorted(n for n in names if not n.endswith(".npy") or n[:-4] not in expected)
        if extra:
            raise bad(f"unexpected member {extra[0][:80]!r} (not in the manifest)")
        missing = sorted(k for k in expected if k not in keys)
        if missing:
            raise bad(f"has no array {missing[0]!r}")
        shapes, total = {}, 0
        for key, info in keys.items():
            want_shape, dtypes, _ = expected[key]
            if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise bad(f"{key}: encrypted or unusual compression")
            try:
                with zf.open(info) as fp:
                    version = np.lib.format.read_magic(fp)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
                    elif version == (2, 0):
                        shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
                    else:
                        raise ValueError(f".npy format version {version}")
                    header = fp.tell()
            except Exception as exc:
                raise bad(f"{key}: unreadable .npy header ({type(exc).__name__}: {exc})") from None
            if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.name not in dtypes:
                raise bad(f"{key}: dtype {dtype.str} refused (expected {'/'.join(sorted(dtypes))})")
            if want_shape is not None and tuple(shape) != tuple(want_shape):
                raise bad(f"{key}: header says {dtype.name}{list(shape)}, the manifest says "
                          f"{dtype.name}{list(want_shape)}")
            size = math.prod(shape) * dtype.itemsize
            if info.file_size != header + size:
                raise bad(f"{key}: member is {info.file_size} bytes, its header says {header + size}")
            total += size
            shapes[key] = tuple(shape)
        if total > MAX_ARRAY_BYTES:
            raise bad(f"arrays total {total} bytes, over the {MAX_ARRAY_BYTES}-byte cap")
        for key, (_, _, same_as) in expected.items():
            if same_as is not None and shapes[key] != shapes[same_as]:
                raise bad(f"{key}: shape {list(shapes[key])}, but {same_as} is {list(shapes[same_as])}")
        arrays = {}
        for key, info in keys.items():
            try:
                with zf.open(info) as fp:
                    arrays[key] = np.lib.format.read_array(fp, allow_pickle=False)
            except Exception as exc:
                raise bad(f"{key}: unreadable array data ({type(exc).__name__}: {exc})") from None
    return arrays


# --------------------------------------------------------------------------
# reading


def load_manifest(directory: Path | str = DEFAULT_DIR) -> dict:
    """Read and vet ``manifest.json``.

    Each entry of ``cases`` is validated (see :func:`load_fixture`); an
    unusable one (not an object, a bad or duplicate name, a wrong field) is
    replaced by a placeholder with a printable ``name`` for which
    :func:`load_fixture` raises that case's :class:`FixtureError`, so one bad
    entry never makes the whole manifest unusable.

    Raises:
      ManifestError: missing or unreadable file (a symlink, not a regular
        file, over :data:`MAX_FILE_BYTES`), unknown format, or a spec version
        newer than this suite's (old suites must not certify new rules).
    """
    path = Path(directory) / "manifest.json"
    try:
        manifest = json.loads(_read_capped(path))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest; run `python -m conformance generate`") from None
    except _Refused as exc:
        raise ManifestError(f"{path}: unreadable manifest ({path.name} {exc})") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path}: unreadable manifest ({type(exc).__name__}: {exc})") from None
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
    seen = set()
    cases = []
    for i, entry in enumerate(manifest["cases"]):
        label = f"<entry {i}>"
        if not isinstance(entry, dict):
            cases.append(_Invalid(label, f"{label}: manifest entry is {_kind(entry)}, expected an object"))
            continue
        try:
            _validate(entry)
        except _Bad as exc:
            name = entry.get("name")
            if isinstance(name, str) and len(name) <= _MAX_NAME and _NAME.fullmatch(name) and name not in seen:
                label = name
                seen.add(name)
            cases.append(_Invalid(label, f"{label}: {exc}"))
            continue
        if entry["name"] in seen:
            cases.append(_Invalid(entry["name"], f"{entry['name']}: manifest field 'name' is a duplicate "
                                  f"(entry {i}); case names must be unique"))
            continue
        seen.add(entry["name"])
        cases.append(entry)
    return {**manifest, "cases": cases}


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

    Nothing outside ``directory`` is read: ``file`` must be a bare ``.npz``
    name, and a symlink, device, FIFO or a file over :data:`MAX_FILE_BYTES`
    is refused unread. The ``.npz`` members and their ``.npy`` headers are
    checked against the manifest before any array data is read.

    Raises:
      FixtureError: one line naming the case and the problem: a malformed
        entry (naming the field), a missing, unsafe or oversized file, a
        sha256 mismatch, an unreadable ``.npz``, or a member missing, extra,
        of the wrong shape or of a refused dtype (object, string, ...).
    """
    if isinstance(entry, _Invalid):
        raise FixtureError(entry.problem)
    if not isinstance(entry, dict):
        raise FixtureError(f"<unnamed>: manifest entry is {_kind(entry)}, expected an object")
    name = entry.get("name")
    name = name if isinstance(name, str) and len(name) <= _MAX_NAME and _NAME.fullmatch(name) else "<unnamed>"
    try:
        refs, wrt = _validate(entry)
    except _Bad as exc:
        raise FixtureError(f"{name}: {exc}") from None
    filename = entry["file"]
    path = Path(directory) / filename
    try:
        data = _read_capped(path)
    except _Refused as exc:
        raise FixtureError(f"{name}: fixture file {filename} {exc}; refused") from None
    except OSError as exc:
        raise FixtureError(f"{name}: cannot read fixture file ({exc.strerror}: {filename})") from None
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise FixtureError(f"{name}: {filename} does not match its sha256 in the manifest (corrupt or edited)")
    arrays = _read_npz(data, _members(entry, refs, wrt), f"{name}: {filename}")

    kwargs = _rebuild(entry["kwargs"], arrays)
    error = entry["error"]
    if error is not None:
        call = Call(name, entry["function"], entry["module"], kwargs, expect_error=error["type"])
        return Fixture(name, entry["component"], entry["tolerance"], call, error_arg=error["arg"])

    def section(prefix, names):
        return {n: arrays[f"{prefix}/{n}"] for n in names}

    wrt = tuple(wrt)
    outs = tuple(entry["outputs"])
    cotangents = section("cot", outs) if wrt else {}
    call = Call(name, entry["function"], entry["module"], kwargs, wrt, cotangents)
    return Fixture(
        name, entry["component"], entry["tolerance"], call,
        outputs=section("out", outs),
        grads=section("grad", wrt),
        grads_out_only=section("grad_out_only", wrt) if wrt and len(outs) > 1 else {},
    )


# --------------------------------------------------------------------------
# writing


def build_fixture(case) -> tuple[dict, dict]:
    """Run ``case`` through numpy_ref in float64; its manifest entry and arrays.

    Returns:
      ``(entry, arrays)``: the entry without ``sha256`` (it depends on the
      bytes finally kept), the arrays by ``.npz`` key.

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
    return entry, arrays


def write_fixture(case, directory: Path) -> dict:
    """Run ``case`` through numpy_ref in float64, write its ``.npz``; the manifest entry.

    Always writes; :func:`generate` is the one that keeps unchanged files.

    Raises:
      RuntimeError: as :func:`build_fixture`.
    """
    entry, arrays = build_fixture(case)
    entry["sha256"] = save_npz(Path(directory) / entry["file"], arrays)
    return entry


def within_noise_floor(old: dict, new: dict) -> tuple[float, str]:
    """How far ``old`` arrays are from ``new`` ones, in units of the noise floor.

    Inputs (``in/``) and cotangents (``cot/``) must be bit-identical, every
    array must have the same key, shape and dtype, bool and integer arrays
    must be equal and non-finite values must match exactly; for float
    outputs and gradients the measure is
    ``max|new - old| / (NOISE_RTOL * max(1, max|old|))`` (see
    :data:`NOISE_RTOL`).

    Returns:
      ``(ratio, detail)``: the worst ratio over the arrays (0.0 when
      bit-identical, ``inf`` for any difference that is not rounding noise)
      and a one-line description of the worst array ("" when ratio is 0).
      The old file may be kept iff ``ratio <= 1``.
    """
    if old.keys() != new.keys():
        gone, added = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
        return math.inf, f"arrays differ (old only: {gone[:3]}, new only: {added[:3]})"
    worst, detail = 0.0, ""
    for key in sorted(new):
        a, b = np.asarray(old[key]), np.asarray(new[key])
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf, f"{key} is {a.dtype.name}{list(a.shape)}, now {b.dtype.name}{list(b.shape)}"
        if np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes():
            continue
        exact = key.startswith(("in/", "cot/")) or b.dtype.kind not in "fc"
        if exact:
            return math.inf, f"{key} changed (inputs, cotangents and masks must be bit-identical)"
        fa, fb = np.isfinite(a), np.isfinite(b)
        if not np.array_equal(fa, fb) or not np.array_equal(a[~fa], b[~fb], equal_nan=True):
            return math.inf, f"{key}: non-finite values moved"
        if not fa.any():
            continue
        scale = max(1.0, float(np.max(np.abs(a[fa]))))
        deviation = float(np.max(np.abs(b[fb] - a[fa])))
        ratio = deviation / (NOISE_RTOL * scale)
        if ratio > worst:
            worst = ratio
            detail = f"{key} moved by {deviation:.3g} (scale {scale:.3g}, floor {NOISE_RTOL * scale:.3g})"
    return worst, detail


@dataclasses.dataclass
class GenerateReport:
    """What :func:`generate` did, or with ``check=True`` would do.

    Attributes:
      manifest: the manifest written (or that would be written).
      written: case names whose file was (would be) written.
      kept: case names whose existing file was left untouched, bit-identical
        or within the noise floor.
      noisy: the subset of ``kept`` that is not bit-identical.
      removed: file names removed (would be): stale cases' files the old
        manifest listed.
      changes: one line per difference between the folder and the catalog,
        ``"<kind> <case>: <detail>"`` with kind ``missing``, ``differs``,
        ``stale`` or ``manifest``.
      manifest_changed: whether ``manifest.json`` was (would be) rewritten.
      worst: the largest deviation kept, in units of the floor (0..1).
      check: True when nothing was written.
    """

    manifest: dict
    written: list = dataclasses.field(default_factory=list)
    kept: list = dataclasses.field(default_factory=list)
    noisy: list = dataclasses.field(default_factory=list)
    removed: list = dataclasses.field(default_factory=list)
    changes: list = dataclasses.field(default_factory=list)
    manifest_changed: bool = False
    worst: float = 0.0
    check: bool = False

    @property
    def clean(self) -> bool:
        """True when the folder already holds what generate writes (within the floor)."""
        return not self.changes and not self.manifest_changed


def _owned_manifest(directory: Path) -> dict | None:
    """The previous manifest of a folder :func:`generate` may write, or None if empty/new.

    Raises:
      FolderError: ``directory`` is not a directory, or is non-empty without
        a readable ``manifest.json`` that has our ``format`` and ``cases``.
    """
    if not directory.exists():
        return None
    if not directory.is_dir():
        raise FolderError(f"{directory}: not a directory; refusing to write fixtures there")
    if not any(directory.iterdir()):
        return None
    refuse = (f"{directory}: not empty and has no fixture manifest of ours "
              "(manifest.json with 'format', 'spec_version' and 'cases'); refusing to write there, pick an empty or new --out")
    try:
        manifest = json.loads(_read_capped(directory / "manifest.json"))
    except (OSError, ValueError, RecursionError, _Refused):
        raise FolderError(refuse) from None
    if (not isinstance(manifest, dict) or type(manifest.get("format")) is not int
            or "spec_version" not in manifest or not isinstance(manifest.get("cases"), list)):
        raise FolderError(refuse)
    return manifest


def _old_state(old: dict | None) -> tuple[dict, set, list]:
    """``({name: entry}, {listed file names}, [labels of nameless entries])`` of a previous manifest.

    A ``file`` that is not a bare ``.npz`` name is left out of the listed
    files: generate never deletes or reads what a malformed entry points at.
    """
    entries, files, nameless = {}, set(), []
    for i, entry in enumerate((old or {}).get("cases", [])):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            nameless.append(f"<entry {i}>")
            continue
        entries.setdefault(name, entry)
        try:
            files.add(_check_file_name(entry))
        except _Bad:
            pass
    return entries, files, nameless


def _json(value) -> str:
    """A canonical text for comparing manifest values (NaN equals NaN, key order ignored)."""
    return json.dumps(value, sort_keys=True)


def _existing(path: Path) -> bytes | None:
    """The bytes of a file generate may compare with; None if absent or unsafe to read."""
    try:
        return _read_capped(path)
    except (OSError, _Refused):
        return None


def generate(directory: Path | str = DEFAULT_DIR, cases=None, check: bool = False) -> GenerateReport:
    """Bring ``directory`` to the fixtures of ``cases``, touching as little as possible.

    ``cases`` (default: the whole catalog) is what the folder holds afterwards.
    Every case is computed first; nothing is written if one fails. Then, for
    each case, an existing file is kept (bytes and sha256 untouched) when
    its arrays equal the fresh ones within the noise floor
    (:func:`within_noise_floor`); otherwise the file is written. The ``.npz``
    files that the previous manifest listed and that are no longer cases are
    removed; no other file is ever removed. ``manifest.json`` is rewritten
    only when its text changes. Files are replaced through a rename, never
    written through a symlink.

    Args:
      directory: the fixture folder; created if missing (not with ``check``).
        It must be new, empty, or hold a ``manifest.json`` of ours.
      cases: the catalog to write, default ``conformance.cases.CASES``.
      check: write nothing; only report what would change.

    Returns:
      A :class:`GenerateReport`; with ``check``, ``report.clean`` says
      whether the folder matches the catalog within the floor.

    Raises:
      FolderError: ``directory`` is not one generate owns, or a case's file
        name is taken by a file the manifest does not list and that differs
        (a user's own file); nothing was written.
      RuntimeError: numpy_ref does not behave as a case says; nothing written.
    """
    from .cases import CASES

    directory = Path(directory)
    old = _owned_manifest(directory)
    old_entries, old_files, nameless = _old_state(old)

    built, problems = [], []
    for case in CASES if cases is None else cases:
        try:
            built.append(build_fixture(case))
        except Exception as exc:  # report every broken case, not just the first
            problems.append(f"{case.name}: {type(exc).__name__}: {exc}")
    if problems:
        raise RuntimeError("fixture generation failed:\n  " + "\n  ".join(problems))

    report = GenerateReport(manifest={}, check=check)
    entries, to_write = [], {}
    for entry, arrays in built:
        name, filename = entry["name"], entry["file"]
        path = directory / filename
        data = _npz_bytes(arrays)
        sha = hashlib.sha256(data).hexdigest()
        previous = old_entries.get(name)
        listed = filename in old_files
        current = _existing(path)
        why = None
        if current is None:
            if not os.path.lexists(path):
                why = f"missing {name}: no file {filename}"
            elif listed and (os.path.islink(path) or os.path.isfile(path)):
                why = f"differs {name}: {filename} is a symlink, too large or unreadable"
            else:
                raise FolderError(f"{path}: exists, is not a readable regular file and manifest.json does "
                                  "not list it; refusing to replace a file that is not ours")
        elif hashlib.sha256(current).hexdigest() != sha:
            try:
                expected = {k: (a.shape, frozenset({a.dtype.name}), None) for k, a in arrays.items()}
                ratio, detail = within_noise_floor(_read_npz(current, expected, f"{name}: {filename}"), arrays)
            except FixtureError as exc:
                ratio, detail = math.inf, str(exc).split(": ", 2)[-1]
            if ratio <= 1.0:
                sha = hashlib.sha256(current).hexdigest()  # keep the old bytes and their sha256
                report.noisy.append(name)
                report.worst = max(report.worst, ratio)
            elif not listed:
                # a file we did not write (the manifest does not list it): never overwrite it
                raise FolderError(f"{path}: not listed in {directory / 'manifest.json'} and not this case's "
                                  "fixture; refusing to overwrite a file that is not ours")
            else:
                why = f"differs {name}: {detail}"
        if why is None:
            report.kept.append(name)
        else:
            report.written.append(name)
            report.changes.append(why)
            to_write[path] = data
        entry = {**entry, "sha256": sha}
        entries.append(entry)
        if why is None and previous is not None and _json(previous) != _json(entry):
            fields = sorted(k for k in entry.keys() | previous.keys()
                            if _json(entry.get(k)) != _json(previous.get(k)))
            report.changes.append(f"manifest {name}: entry differs in {', '.join(fields)}")
        elif why is None and previous is None:
            report.changes.append(f"manifest {name}: not listed in manifest.json")

    names = {e["name"] for e in entries}
    files = {e["file"] for e in entries}
    for name in sorted(n for n in old_entries if n not in names):
        shown = name if len(name) <= _MAX_NAME and _NAME.fullmatch(name) else ascii(name[:80])
        report.changes.append(f"stale {shown}: no longer a case")
    for label in nameless:
        report.changes.append(f"stale {label}: a manifest entry without a name")
    for filename in sorted(old_files - files):
        path = directory / filename
        if os.path.lexists(path) and (os.path.islink(path) or os.path.isfile(path)):
            report.removed.append(filename)

    manifest = {"format": FORMAT, "spec_version": spec_version(), "cases": entries}
    text = json.dumps(manifest, indent=1) + "\n"
    report.manifest = manifest
    report.manifest_changed = _existing(directory / "manifest.json") != text.encode()
    if report.manifest_changed and not report.changes:
        top = {k: v for k, v in (old or {}).items() if k != "cases"}
        if top != {"format": FORMAT, "spec_version": spec_version()}:
            report.changes.append(f"manifest manifest.json: format/spec_version {top} differ")
        else:
            report.changes.append("manifest manifest.json: differs in order or layout")
    if check:
        return report

    directory.mkdir(parents=True, exist_ok=True)
    for path, data in to_write.items():
        _write_atomic(path, data)
    # stale files go before the new manifest is written: an interrupted run
    # leaves them listed in the old one, so the next run still removes them
    for filename in report.removed:
        os.remove(directory / filename)
    if report.manifest_changed:
        _write_atomic(directory / "manifest.json", text.encode())
    return report
