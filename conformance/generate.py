"""Writing the fixtures from the catalog: ``python -m conformance generate [--check]``.

:func:`generate` only touches a folder it owns (empty, or holding a manifest
of ours), computes every case before writing anything, only removes ``.npz``
files the previous manifest listed, and keeps an existing file whose arrays
agree with the fresh ones within :data:`NOISE_RTOL`, so regenerating on
another machine does not churn the committed fixtures with rounding noise.
The format itself is described in ``conformance.fixtures``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from .fixtures import (  # the format, and the readers' own checks, shared with the writer
    DEFAULT_DIR, FORMAT, REFERENCE_DTYPES, FixtureError, _Bad, _check_file_name,
    _npz_bytes, _read_capped, _read_npz, _Refused, _sections, _write_atomic, case_file, save_npz,
    skeleton, spec_version,
)
from .protocol import flatten
from .vocabulary import CASE_NAME, FLOAT32_OUTPUTS, MAX_NAME_LENGTH, component, output_names

__all__ = [
    "NOISE_RTOL", "REFERENCE_NOISE", "FolderError", "GenerateReport",
    "build_fixture", "write_fixture", "within_noise_floor", "reference_errors", "generate",
    "manifest_text",
]

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

#: Noise rule of the stored reference errors, per dtype: a regenerated value
#: ``new`` keeps the committed ``old`` when ``old / f <= new <= old * f`` (both
#: 0 counts as equal), and only when the case's ``.npz`` is kept too (a case
#: whose float64 arrays changed gets fresh values). Measured on the catalog,
#: the committed values (OpenBLAS SkylakeX kernels, numpy's AVX-512 loops)
#: against a regeneration with ``OPENBLAS_CORETYPE`` = Haswell / Sandybridge
#: and ``NPY_DISABLE_CPU_FEATURES`` down to X86_V3 / X86_V2: float32 moves by
#: up to 4.1x (BLAS kernels) and 8.8x (BLAS and SSE-only numpy; 3% of the
#: arrays move by more than 2x, all of them sums that cancel: bias gradients,
#: fully masked rows); bfloat16 and float16 (numpy's and ml_dtypes' own loops,
#: softmax in float32) by 1.37x, on one gradient whose true value is 0
#: (``sdpa/cross/bias-broadcast`` bias, 2e-7). Factors: 16 for float32, 1.5
#: for the halves (a real change of the half-precision recipe moves them by
#: more).
REFERENCE_NOISE = {"float32": 16.0, "bfloat16": 1.5, "float16": 1.5}


class FolderError(RuntimeError):
    """:func:`generate` refuses a folder it does not own; nothing was written."""


def build_fixture(case, reference_dtypes=REFERENCE_DTYPES) -> tuple[dict, dict]:
    """Run ``case`` through numpy_ref in float64; its manifest entry and arrays.

    ``reference_dtypes``: the dtypes whose reference errors are computed
    (:func:`reference_errors`); the manifest needs all of
    :data:`~conformance.fixtures.REFERENCE_DTYPES` (bfloat16 needs
    ``ml_dtypes``), an in-memory fixture (``conformance.fuzz``) only the
    dtype it is judged in.

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
        "component": component(case.name),
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
    entry["reference_error"] = (None if case.error is not None
                                else reference_errors(case.name, call, arrays, reference_dtypes))
    entry["file"] = case_file(case.name)
    return entry, arrays


def _round_up(x: float) -> float:
    """``x`` rounded *up* to two significant digits (0 stays 0): 3.01e-4 -> 3.1e-4."""
    if x == 0.0:
        return 0.0
    exponent = math.floor(math.log10(x)) - 1
    mantissa = math.ceil(x / 10.0 ** exponent)
    value = float(f"{mantissa}e{exponent}")
    while value < x:  # log10 and the division may round down
        mantissa += 1
        value = float(f"{mantissa}e{exponent}")
    return value


def _low_dtype(name: str):
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise RuntimeError("generating fixtures needs ml_dtypes (numpy_ref's bfloat16, for the stored "
                           "bfloat16 reference errors); pip install ml_dtypes") from None
    return np.dtype(ml_dtypes.bfloat16)


def reference_errors(name: str, call, arrays: dict, dtypes=REFERENCE_DTYPES) -> dict:
    """The ``reference_error`` field of a value case (see ``conformance.fixtures``).

    numpy_ref runs on the inputs and cotangents cast to each dtype of
    ``dtypes`` (by default :data:`~conformance.fixtures.REFERENCE_DTYPES`; exact: the catalog's
    inputs are bfloat16 and float16 numbers); per output and gradient,
    ``max |ref - fixture|`` over the fixture's finite elements, rounded up to
    two significant digits. A bool or integer output (a mask, greedy token
    ids) is compared exactly, in every dtype: numpy_ref's must equal the
    fixture's and its stored error is 0.

    Raises:
      RuntimeError: naming the case, dtype and array, when numpy_ref in that
        dtype gives a non-finite value where the fixture is finite (or a
        finite one where it is not), an array of another dtype, or bool or
        integer values other than the fixture's. Such a
        case cannot be judged by a multiple of the reference's error; the
        catalog must scale its inputs into the dtype's range.
    """
    from .invoke import cast_floats, numpy_backward, numpy_forward, with_dtype

    outputs = output_names(call.function)
    result = {}
    for dtype_name in dtypes:
        dtype = _low_dtype(dtype_name)
        kwargs = with_dtype(cast_floats(call.kwargs, dtype), dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, by name
            got = {"out": numpy_forward(call.function, kwargs)}
            if call.wrt:
                cotangents = cast_floats(call.cotangents, dtype)
                got["grad"] = numpy_backward(call, kwargs, cotangents)
                if len(outputs) > 1:
                    got["grad_out_only"] = numpy_backward(call, kwargs, {"out": cotangents["out"]})
        per = {}
        for section, names in _sections(outputs, call.wrt).items():
            per[section] = {}
            for n in names:
                value, want = np.asarray(got[section][n]), arrays[f"{section}/{n}"]
                where = f"{name}: numpy_ref in {dtype_name}, {section} {n}"
                exact = want.dtype.kind in "bi"  # a mask or token ids: the fixture's own dtype, exact
                expected = want.dtype if exact else dtype
                if section == "out" and (call.function, n) in FLOAT32_OUTPUTS and dtype.itemsize < 4:
                    expected = np.dtype(np.float32)  # lse in half precision stays float32
                if value.dtype != expected:
                    raise RuntimeError(f"{where}: dtype {value.dtype}, expected {expected}")
                if exact:
                    if not np.array_equal(value, want):
                        raise RuntimeError(f"{where}: differs from the float64 fixture")
                    per[section][n] = 0.0
                    continue
                value = value.astype(np.float64)
                finite = np.isfinite(want)
                if not np.array_equal(np.isfinite(value), finite) or not np.array_equal(
                        value[~finite], want[~finite], equal_nan=True):
                    raise RuntimeError(
                        f"{where}: non-finite where the fixture is finite, or not matching its "
                        f"infinities ({int((np.isfinite(value) != finite).sum())} elements); the case "
                        f"cannot be judged by a multiple of the reference error, scale its inputs")
                error = float(np.max(np.abs(value[finite] - want[finite]), initial=0.0))
                per[section][n] = _round_up(error)
        result[dtype_name] = per
    return result


def _same_reference_errors(old, new) -> bool:
    """Whether two ``reference_error`` fields agree within :data:`REFERENCE_NOISE`."""
    if not isinstance(old, dict) or not isinstance(new, dict) or old.keys() != new.keys():
        return False
    if not all(d in REFERENCE_NOISE for d in new):
        return False
    for dtype, sections in new.items():
        if not isinstance(old[dtype], dict) or old[dtype].keys() != sections.keys():
            return False
        for section, errors in sections.items():
            before = old[dtype][section]
            if not isinstance(before, dict) or before.keys() != errors.keys():
                return False
            for n, e in errors.items():
                o = before[n]
                if type(o) not in (int, float) or isinstance(o, bool):
                    return False
                f = REFERENCE_NOISE[dtype]
                if not (o == e or (o > 0 and e > 0 and o / f <= e <= o * f)):
                    return False
    return True


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


def manifest_text(manifest: dict) -> str:
    """The manifest as written: valid JSON with one case per line, compact inside
    a line (the fixtures' size budget) and still a one-line diff per changed case."""
    head = json.dumps({k: v for k, v in manifest.items() if k != "cases"})
    lines = ",\n".join(json.dumps(case, separators=(",", ":")) for case in manifest["cases"])
    return head[:-1] + (', "cases": [\n' + lines + "\n]}\n" if manifest["cases"] else ', "cases": []}\n')


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
      cases: the catalog to write, default ``conformance.catalog.CASES``.
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
    from .catalog import CASES

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
        if (why is None and previous is not None and entry["reference_error"] is not None
                and _same_reference_errors(previous.get("reference_error"), entry["reference_error"])):
            entry["reference_error"] = previous["reference_error"]  # machine noise: keep the committed values
        entries.append(entry)
        if why is None and previous is not None and _json(previous) != _json(entry):
            fields = sorted(k for k in entry.keys() | previous.keys()
                            if (k in entry) != (k in previous) or _json(entry.get(k)) != _json(previous.get(k)))
            report.changes.append(f"manifest {name}: entry differs in {', '.join(fields)}")
        elif why is None and previous is None:
            report.changes.append(f"manifest {name}: not listed in manifest.json")

    names = {e["name"] for e in entries}
    files = {e["file"] for e in entries}
    for name in sorted(n for n in old_entries if n not in names):
        shown = name if len(name) <= MAX_NAME_LENGTH and CASE_NAME.fullmatch(name) else ascii(name[:80])
        report.changes.append(f"stale {shown}: no longer a case")
    for label in nameless:
        report.changes.append(f"stale {label}: a manifest entry without a name")
    for filename in sorted(old_files - files):
        path = directory / filename
        if os.path.lexists(path) and (os.path.islink(path) or os.path.isfile(path)):
            report.removed.append(filename)

    manifest = {"format": FORMAT, "spec_version": spec_version(), "cases": entries}
    text = manifest_text(manifest)
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
