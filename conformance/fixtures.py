"""Fixture files: their format, and reading them back as Calls (writing: ``conformance.generate``).

Layout of ``conformance/fixtures/``:

- ``manifest.json``: ``{"format", "spec_version", "cases": [...]}``; each case
  has its name, function, module, tolerance class, note, seed, the
  ``kwargs`` skeleton (config values inline, each array replaced by
  ``{"$array": "<flat name>", "shape": [...], "dtype": "..."}``), ``wrt``,
  ``outputs``, ``error`` (``{"type", "arg", "message"}`` or null),
  ``reference_error`` (null for an error case) and the ``file`` with its
  ``sha256``.
- ``reference_error`` (format 2): per dtype of :data:`REFERENCE_DTYPES`,
  ``{"out": {output: e}, "grad": {wrt name: e}}`` (and ``"grad_out_only"``
  when the ``.npz`` has that section), where ``e = max |ref - fixture|`` over
  the finite fixture elements, ``ref`` being numpy_ref run on the inputs
  and cotangents cast to that dtype (exact by construction of the catalog),
  rounded *up* to two significant digits. The tolerance of a low-precision
  run is a multiple of it (``conformance.tolerances.bounds``); storing it
  here means a checker needs neither a framework nor ml_dtypes. A bool or
  int64 output (a mask, greedy token ids) is compared exactly in every
  dtype; numpy_ref's equals the fixture there and its stored error is 0.
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

Writing (:func:`conformance.generate.generate`) only touches a folder it owns (empty, or holding a
manifest of ours), only removes ``.npz`` files the previous manifest listed,
and keeps an existing file whose arrays agree with the fresh ones within
:data:`conformance.generate.NOISE_RTOL`, so regenerating on another machine does not churn the
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

from .protocol import Call
from .tolerances import CLASSES
from .vocabulary import CASE_NAME, MAX_NAME_LENGTH, REFERENCE_DTYPES, component as _component

__all__ = [
    "FORMAT", "REFERENCE_DTYPES", "DEFAULT_DIR", "MAX_FILE_BYTES", "MAX_ARRAY_BYTES",
    "ManifestError", "FixtureError", "Fixture",
    "spec_version", "load_manifest", "load_fixture", "fixture_from_arrays", "save_npz", "skeleton", "case_file",
]

FORMAT = 2
DEFAULT_DIR = Path(__file__).parent / "fixtures"

#: Largest fixture or manifest file read, in bytes. The committed files are
#: at most 64 KiB (the manifest ~0.3 MiB); the cap is there so that a hostile
#: or broken folder cannot make the loader read without bound.
MAX_FILE_BYTES = 64 * 2**20
#: Largest total uncompressed size of one case's arrays, from the ``.npy``
#: headers, checked before decompressing (a zip bomb is refused unread).
MAX_ARRAY_BYTES = 64 * 2**20

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FLAT = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\.npz")
_SHA256 = re.compile(r"[0-9a-f]{64}")
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


class _Recent:
    """Values by key, the least recently used dropped once their sizes (``size_of``)
    add up to more than ``budget`` bytes; a value larger than the whole budget is not kept."""

    def __init__(self, budget: int, size_of):
        self.budget, self.size_of, self.items, self.size = budget, size_of, {}, 0

    def get(self, key):
        value = self.items.pop(key, None)
        if value is not None:
            self.items[key] = value  # (re)inserted last: the most recently used
        return value

    def put(self, key, value) -> None:
        size = self.size_of(value)
        if size > self.budget:
            return
        while self.items and self.size + size > self.budget:
            self.size -= self.size_of(self.items.pop(next(iter(self.items))))
        self.items[key] = value
        self.size += size


#: ``_npz_bytes``'s recent answers, by a digest of the arrays they encode (``generate``
#: encodes a case to compare it byte for byte with its file, and deflating is most of that;
#: the catalog's files are about 7 MB)
_ENCODED = _Recent(64 * 2**20, len)


def _npz_bytes(arrays: dict) -> bytes:
    """The deterministic compressed ``.npz`` of ``arrays`` (sorted keys, fixed timestamp).

    A pure function of the arrays' names, dtypes, shapes and bytes, so the
    same arrays encoded again in this process are not deflated again."""
    digest = hashlib.blake2b(digest_size=20)
    for key in sorted(arrays):
        array = np.asarray(arrays[key], order="C")
        digest.update(repr((key, array.dtype.str, array.shape)).encode())
        digest.update(array.tobytes())
    key = digest.digest()
    data = _ENCODED.get(key)
    if data is None:
        data = _deflated_npz(arrays)
        _ENCODED.put(key, data)
    return data


def _deflated_npz(arrays: dict) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            body = io.BytesIO()
            np.lib.format.write_array(body, np.asarray(arrays[key], order="C"), allow_pickle=False)  # 0-d stays 0-d (ascontiguousarray makes it (1,))
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


#: JSON kinds for messages; bool before int (a bool is an int in Python)
_KINDS = ((type(None), "null"), (bool, "a boolean"), (int, "an integer"), (float, "a number"),
          (str, "a string"), (list, "a list"), (dict, "an object"))


def _kind(value) -> str:
    """The JSON kind of ``value``, for messages."""
    return next((name for t, name in _KINDS if isinstance(value, t)), type(value).__name__)


def _string(entry: dict, field: str, pattern: re.Pattern | None = None, what: str = "") -> str:
    if field not in entry:
        raise _Bad(field, "is missing")
    value = entry[field]
    if not isinstance(value, str):
        raise _Bad(field, f"must be a string, got {_kind(value)}")
    if pattern is not None and (len(value) > MAX_NAME_LENGTH or not pattern.fullmatch(value)):
        raise _Bad(field, f"must be {what}, got {value[:80]!r}")
    return value


def _string_list(entry: dict, field: str, pattern: re.Pattern, what: str) -> list:
    if field not in entry:
        raise _Bad(field, "is missing")
    value = entry[field]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Bad(field, f"must be a list of strings, got {_kind(value)}")
    bad = [v for v in value if len(v) > MAX_NAME_LENGTH or not pattern.fullmatch(v)]
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
    if len(value) > MAX_NAME_LENGTH or not _FILE.fullmatch(value):
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
    name = _string(entry, "name", CASE_NAME, "a case name like 'component/variant' (a-z 0-9 _ . + -)")
    component = _string(entry, "component")
    if component != _component(name):
        raise _Bad("component", f"is {component[:80]!r}, the name says {_component(name)!r}")
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
    _check_reference_error(entry, outputs, wrt)
    _check_file_name(entry)
    _string(entry, "sha256", _SHA256, "64 lower-case hex digits")
    return refs, wrt


def _sections(outputs: list, wrt: list) -> dict:
    """``{section: names}`` of a value case's reference errors (and ``.npz`` sections)."""
    sections = {"out": list(outputs), "grad": list(wrt)}
    if wrt and len(outputs) > 1:
        sections["grad_out_only"] = list(wrt)
    return sections


def _check_reference_error(entry: dict, outputs: list, wrt: list) -> None:
    """``reference_error``: null for an error case; else per dtype of
    :data:`REFERENCE_DTYPES` one finite number >= 0 per output and gradient."""
    field = "reference_error"
    if field not in entry:
        raise _Bad(field, "is missing")
    value = entry[field]
    if entry["error"] is not None:
        if value is not None:
            raise _Bad(field, f"must be null for an error case, got {_kind(value)}")
        return
    if not isinstance(value, dict):
        raise _Bad(field, f"must be an object, got {_kind(value)}")
    if sorted(value) != sorted(REFERENCE_DTYPES):
        raise _Bad(field, f"must have exactly the dtypes {', '.join(REFERENCE_DTYPES)}, "
                          f"got {', '.join(map(str, value))[:80] or 'none'}")
    sections = _sections(outputs, wrt)
    for dtype in REFERENCE_DTYPES:
        per = value[dtype]
        if not isinstance(per, dict) or sorted(per) != sorted(sections):
            got = _kind(per) if not isinstance(per, dict) else ", ".join(map(str, per))[:80]
            raise _Bad(field, f"{dtype} must have exactly {', '.join(sections)}, got {got}")
        for section, names in sections.items():
            errors = per[section]
            if not isinstance(errors, dict) or sorted(errors) != sorted(names):
                got = _kind(errors) if not isinstance(errors, dict) else ", ".join(map(str, errors))[:80]
                raise _Bad(field, f"{dtype}.{section} must name exactly {', '.join(names) or 'nothing'}, got {got}")
            for name, e in errors.items():
                if type(e) not in (int, float) or not math.isfinite(e) or e < 0:
                    raise _Bad(field, f"{dtype}.{section}.{name} must be a finite number >= 0, got {str(e)[:40]}")


def _members(entry: dict, refs: dict, wrt: list) -> dict:
    """``{key: (shape or None, allowed dtype names, shape-as key or None)}`` of one case's ``.npz``."""
    expected = {f"in/{n}": (shape, frozenset({dtype}), None) for n, (shape, dtype) in refs.items()}
    if entry["error"] is not None:
        return expected
    outputs = entry["outputs"]
    for o in outputs:
        expected[f"out/{o}"] = (None, _FLOATS | {"bool", "int64"}, None)  # int64: greedy tokens
        if wrt:
            expected[f"cot/{o}"] = (None, _FLOATS, f"out/{o}")
    sections = ("grad", "grad_out_only") if wrt and len(outputs) > 1 else ("grad",)
    for prefix in sections:
        for n in wrt:
            expected[f"{prefix}/{n}"] = (refs[n][0], _FLOATS, None)
    return expected


#: the arrays of the ``.npz`` files read so far, by their bytes and what they were checked
#: against (see :func:`_read_npz`); the catalog's arrays hold about 8 MB
_READ = _Recent(256 * 2**20, lambda arrays: sum(a.nbytes for a in arrays.values()))


def _read_npz(data: bytes, expected: dict, where: str) -> dict:
    """The arrays of an ``.npz`` (fresh, writable copies), after checking it against ``expected``.

    The same bytes checked against the same ``expected`` give the same arrays,
    so a file this process has read before is not parsed again: the catalog's
    ~530 files take about a second to check and parse, and a process that loads
    the fixtures several times (the tests, a program calling the runner)
    would pay it each time. The key is a digest of the bytes themselves, never
    a file's name or time, so a changed file is always read anew; a refused
    file is never kept, and is refused again with its message.
    """
    key = (hashlib.blake2b(data, digest_size=20).digest(),
           frozenset((k, None if s is None else tuple(s), d, same) for k, (s, d, same) in expected.items()))
    kept = _READ.get(key)
    if kept is None:
        kept = _parse_npz(data, expected, where)
        for array in kept.values():
            array.flags.writeable = False
        _READ.put(key, kept)
    return {k: a.copy() for k, a in kept.items()}


def _parse_npz(data: bytes, expected: dict, where: str) -> dict:
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
            if isinstance(name, str) and len(name) <= MAX_NAME_LENGTH and CASE_NAME.fullmatch(name) and name not in seen:
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
    #: ``{dtype: {"out"|"grad"|"grad_out_only": {name: e}}}`` (see ``reference_error``)
    reference_error: dict = dataclasses.field(default_factory=dict)


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
    name = name if isinstance(name, str) and len(name) <= MAX_NAME_LENGTH and CASE_NAME.fullmatch(name) else "<unnamed>"
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
    return fixture_from_arrays(entry, arrays)


def fixture_from_arrays(entry: dict, arrays: dict) -> Fixture:
    """The :class:`Fixture` of a manifest entry and its arrays by ``.npz`` key, in memory.

    What :func:`load_fixture` returns once the file is read and checked; also
    what ``conformance.fuzz`` judges a fresh configuration with, straight from
    :func:`conformance.generate.build_fixture` (``(entry, arrays)``, trusted:
    nothing here validates them).
    """
    name = entry["name"]
    kwargs = _rebuild(entry["kwargs"], arrays)
    error = entry["error"]
    if error is not None:
        call = Call(name, entry["function"], entry["module"], kwargs, expect_error=error["type"])
        return Fixture(name, entry["component"], entry["tolerance"], call, error_arg=error["arg"])

    def section(prefix, names):
        return {n: arrays[f"{prefix}/{n}"] for n in names}

    wrt = tuple(entry["wrt"])
    outs = tuple(entry["outputs"])
    cotangents = section("cot", outs) if wrt else {}
    call = Call(name, entry["function"], entry["module"], kwargs, wrt, cotangents)
    return Fixture(
        name, entry["component"], entry["tolerance"], call,
        outputs=section("out", outs),
        grads=section("grad", wrt),
        grads_out_only=section("grad_out_only", wrt) if wrt and len(outs) > 1 else {},
        reference_error=entry["reference_error"],
    )
