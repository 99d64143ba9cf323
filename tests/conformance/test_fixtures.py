"""The catalog and the committed fixtures: coverage, size, and reproducibility."""
from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import os
import shutil
import zipfile
from collections import Counter

import numpy as np
import pytest

import numpy_ref
from conformance import fixtures as fixtures_module
from conformance.catalog import CASES, cases
from conformance.vocabulary import CASE_NAME, COMPONENTS, NOT_DIFFERENTIABLE, component
from conformance.fixtures import (
    DEFAULT_DIR, MAX_FILE_BYTES, FixtureError, ManifestError, case_file, load_fixture, load_manifest,
)
from conformance.generate import _same_reference_errors, generate
from conformance.protocol import flatten
from conformance.runner import load_all

# Regenerating must reproduce the committed arrays. Not bit for bit: numpy's
# float64 is deterministic for a given BLAS, but another BLAS (or thread count,
# or SIMD width) sums a matmul in another order, which moves results by a few
# ulps (~1e-16 relative), amplified by the conditioning of a case (scores of
# 1e4 cost about four digits: ~1e-12). rtol=1e-12 tolerates reordering and
# still catches any change of semantics, which moves results by >= 1e-8.
RTOL, ATOL = 1e-12, 1e-13


def test_catalog_covers_every_component_with_enough_cases():
    values = Counter(component(c.name) for c in cases(error=False))
    errors = Counter(component(c.name) for c in cases(error=True))
    assert sum(values.values()) >= 60
    assert set(values) == set(COMPONENTS)
    assert set(errors) == set(COMPONENTS)


@pytest.mark.parametrize(
    "needle",
    ["/padding", "/causal", "padding+causal", "fully-masked", "/cross/", "length1", "odd-d",
     "/pre/", "/post/", "/relu", "/gelu", "dropout", "large-scores", "/bias", "mask_to_bias",
     "/final-norm", "/no-final-norm", "/error/"],
)
def test_catalog_has_the_spec_section_4_cases(needle):
    assert any(needle in c.name for c in CASES), needle


def test_every_value_case_differentiates_every_float_input():
    for case in cases(error=False):
        call = case.call()
        floats = {n for n, a in flatten(call.kwargs).items() if isinstance(a, np.ndarray) and a.dtype.kind == "f"}
        forward_only = case.function in NOT_DIFFERENTIABLE or case.forward_only
        assert set(call.wrt) == (set() if forward_only else floats), case.name
        assert bool(call.cotangents) == bool(call.wrt), case.name


def test_manifest_matches_the_catalog_and_the_spec_version():
    manifest = load_manifest()
    assert manifest["spec_version"] == numpy_ref.SPEC_VERSION
    assert [e["name"] for e in manifest["cases"]] == [c.name for c in CASES]
    for entry, case in zip(manifest["cases"], CASES):
        assert entry["tolerance"] == case.tolerance
        assert (entry["error"] or {}).get("arg") == (case.error[1] if case.error else None)


def test_fixtures_stay_small():
    # 6.5 MiB, was 6 (and 5): the modern variants (GQA/MQA, RoPE, ALiBi, softcap; 89 cases of
    # B <= 2, lengths <= 7, head widths <= 8) added ~1 MiB to the 4.85 MiB the catalog had, the
    # sharded cases (24 of B = 2, H = 4, L = 8) another 0.33 MiB (6.23 MiB); 7 MiB since the
    # libraries' layer shapes (catalog/libraries.py: 10 cases of B = 3, L = 7) added 0.3 MiB (6.5 MiB);
    # 7.5 MiB since the sharded KV cache (SPEC 3.25: 3 value cases of B = 2, L = 6, D <= 16 and 3
    # error cases, 41 KiB) took the total past 7 MiB (7.02 MiB)
    total = sum(p.stat().st_size for p in DEFAULT_DIR.iterdir())
    assert total < 7.5 * 2**20, f"{total / 2**20:.2f} MiB"


def test_regenerated_fixtures_agree_with_the_committed_copies(tmp_path):
    pytest.importorskip("ml_dtypes")  # the bfloat16 reference errors
    fresh = generate(tmp_path).manifest
    committed = load_manifest()
    # the reference errors may move with the BLAS kernels and SIMD level of the machine:
    # within generate's documented noise factor (REFERENCE_NOISE); everything else exactly
    strip = ("sha256", "reference_error")
    assert [{k: v for k, v in e.items() if k not in strip} for e in fresh["cases"]] == [
        {k: v for k, v in e.items() if k not in strip} for e in committed["cases"]
    ]
    moved = [new["name"] for new, old in zip(fresh["cases"], committed["cases"])
             if new["reference_error"] != old["reference_error"]
             and not _same_reference_errors(old["reference_error"], new["reference_error"])]
    assert moved == []
    for new_entry, old_entry in zip(fresh["cases"], committed["cases"]):
        new, old = load_fixture(new_entry, tmp_path), load_fixture(old_entry, DEFAULT_DIR)
        for section in ("outputs", "grads", "grads_out_only"):
            a, b = getattr(new, section), getattr(old, section)
            assert a.keys() == b.keys()
            for name in a:
                np.testing.assert_allclose(
                    a[name], b[name], rtol=RTOL, atol=ATOL, err_msg=f"{new.name} {section} {name}"
                )
        for name, a in flatten(new.call.kwargs).items():
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, flatten(old.call.kwargs)[name], err_msg=f"{new.name} {name}")


def test_manifest_is_plain_json_with_a_checksum_per_file():
    manifest = json.loads((DEFAULT_DIR / "manifest.json").read_text())
    files = {e["file"] for e in manifest["cases"]}
    assert files == {p.name for p in DEFAULT_DIR.glob("*.npz")}
    assert all(len(e["sha256"]) == 64 for e in manifest["cases"])


def test_every_committed_fixture_passes_the_manifest_and_member_checks():
    manifest = load_manifest()
    loaded = [load_fixture(entry) for entry in manifest["cases"]]
    assert len(loaded) == len(CASES)


# --------------------------------------------------------------------------
# malformed manifests: one FixtureError per bad case, naming it and the field

VALUE = "sdpa/cross/none"
ERROR = "masks/error/padding-lengths-and-tokens"


@functools.lru_cache(maxsize=None)
def _committed_cases() -> dict:
    """The committed manifest's entries by name, read once (callers get deep copies)."""
    return {e["name"]: e for e in load_manifest()["cases"]}


def _committed_entry(name):
    return copy.deepcopy(_committed_cases()[name])


def _folder(tmp_path, entries, files=(VALUE, ERROR)):
    """A fixture folder holding ``entries`` as its manifest and the committed files of ``files``."""
    folder = tmp_path / "fixtures"
    folder.mkdir(exist_ok=True)
    for name in files:
        shutil.copy(DEFAULT_DIR / case_file(name), folder / case_file(name))
    manifest = {"format": fixtures_module.FORMAT, "spec_version": numpy_ref.SPEC_VERSION, "cases": entries}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _problems(folder):
    """``{name: message}`` of every case of ``folder`` that does not load, as the runner sees them."""
    fixtures, broken = load_all(folder)
    return {b.name: b.problem for b in broken}, [f.name for f in fixtures]


def _set(field, value):
    def mutate(entry):
        entry[field] = value
        return entry
    return mutate


def _drop(field):
    def mutate(entry):
        del entry[field]
        return entry
    return mutate


def _kwarg(key, value):
    def mutate(entry):
        entry["kwargs"][key] = value
        return entry
    return mutate


MALFORMED = {
    # (mutation, label the message starts with, words it must contain)
    "a string": (lambda e: VALUE, "<entry 0>", ["a string", "expected an object"]),
    "null": (lambda e: None, "<entry 0>", ["null", "expected an object"]),
    "a list": (lambda e: [e], "<entry 0>", ["a list", "expected an object"]),
    "wrt as an int": (_set("wrt", 3), VALUE, ["'wrt'", "list of strings", "integer"]),
    "wrt naming no input": (_set("wrt", ["q", "nope"]), VALUE, ["'wrt'", "'nope'"]),
    "wrt naming a mask": (_set("wrt", ["mask"]), VALUE, ["'wrt'"]),
    "missing name": (_drop("name"), "<entry 0>", ["'name'", "missing"]),
    "name an int": (_set("name", 7), "<entry 0>", ["'name'", "must be a string"]),
    "name with dotdot": (_set("name", "sdpa/../../etc"), "<entry 0>", ["'name'", "component/variant"]),
    "name with a space": (_set("name", "sdpa/cross none"), "<entry 0>", ["'name'"]),
    "name without variant": (_set("name", "sdpa"), "<entry 0>", ["'name'"]),
    "component not the name's": (_set("component", "mha"), VALUE, ["'component'"]),
    "missing function": (_drop("function"), VALUE, ["'function'", "missing"]),
    "function a dotted path": (_set("function", "os.system"), VALUE, ["'function'", "identifier"]),
    "function a list": (_set("function", ["softmax"]), VALUE, ["'function'", "a list"]),
    "missing module": (_drop("module"), VALUE, ["'module'", "missing"]),
    "module null": (_set("module", None), VALUE, ["'module'", "null"]),
    "unknown tolerance class": (_set("tolerance", "loose"), VALUE, ["'tolerance'", "'loose'"]),
    "missing kwargs": (_drop("kwargs"), VALUE, ["'kwargs'", "missing"]),
    "kwargs a list": (_set("kwargs", []), VALUE, ["'kwargs'", "an object"]),
    "array ref with a string shape": (
        _kwarg("q", {"$array": "q", "shape": "2,3", "dtype": "float64"}), VALUE, ["'kwargs'", "shape"]),
    "array ref with a negative shape": (
        _kwarg("q", {"$array": "q", "shape": [-1], "dtype": "float64"}), VALUE, ["'kwargs'", "shape"]),
    "array ref of object dtype": (
        _kwarg("q", {"$array": "q", "shape": [2, 3, 5, 4], "dtype": "object"}), VALUE, ["'kwargs'", "'object'"]),
    "array ref renamed": (
        _kwarg("q", {"$array": "k", "shape": [2, 3, 5, 4], "dtype": "float64"}), VALUE, ["'kwargs'", "named"]),
    "array ref of 8 GB": (
        _kwarg("q", {"$array": "q", "shape": [2**30], "dtype": "float64"}), VALUE, ["'kwargs'", "cap"]),
    "missing outputs": (_drop("outputs"), VALUE, ["'outputs'", "missing"]),
    "outputs a string": (_set("outputs", "out"), VALUE, ["'outputs'", "list of strings"]),
    "outputs holding a number": (_set("outputs", ["out", 1]), VALUE, ["'outputs'", "list of strings"]),
    "missing error": (_drop("error"), VALUE, ["'error'", "missing"]),
    "error a string": (_set("error", "ValueError"), VALUE, ["'error'", "a string"]),
    "error without arg": (_set("error", {"type": "ValueError", "message": "x"}), VALUE, ["'error'", "'arg'"]),
    "missing file": (_drop("file"), VALUE, ["'file'", "missing"]),
    "file an int": (_set("file", 1), VALUE, ["'file'", "must be a string"]),
    "file /dev/zero": (_set("file", "/dev/zero"), VALUE, ["'file'", "bare file name"]),
    "file in a subfolder": (_set("file", "sub/x.npz"), VALUE, ["'file'", "bare file name"]),
    "file going up": (_set("file", "../fixtures/sdpa__cross__none.npz"), VALUE, ["'file'", "bare file name"]),
    "file with a backslash": (_set("file", "..\\x.npz"), VALUE, ["'file'", "bare file name"]),
    "file dotdot": (_set("file", ".."), VALUE, ["'file'", "bare file name"]),
    "file not an npz": (_set("file", "manifest.json"), VALUE, ["'file'", ".npz"]),
    "missing sha256": (_drop("sha256"), VALUE, ["'sha256'", "missing"]),
    "sha256 a number": (_set("sha256", 12), VALUE, ["'sha256'", "must be a string"]),
    "sha256 too short": (_set("sha256", "abc"), VALUE, ["'sha256'", "hex"]),
    "seed a string": (_set("seed", "42"), VALUE, ["'seed'"]),
}


@pytest.mark.parametrize("variant", list(MALFORMED))
def test_malformed_manifest_entry_is_a_one_line_fixture_error_naming_case_and_field(tmp_path, variant):
    mutate, label, words = MALFORMED[variant]
    good = _committed_entry(ERROR)
    folder = _folder(tmp_path, [mutate(_committed_entry(VALUE)), good])
    manifest = load_manifest(folder)
    with pytest.raises(FixtureError) as info:
        load_fixture(manifest["cases"][0], folder)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{label}: "), message
    for word in words:
        assert word in message, message
    # the runner reports it as one broken case; the good case still loads
    broken, loaded = _problems(folder)
    assert broken == {label: message} and loaded == [ERROR]


@pytest.mark.parametrize("variant", ["wrt as an int", "file /dev/zero", "missing kwargs", "sha256 a number"])
def test_load_fixture_validates_a_raw_entry_too(variant):
    mutate, _, words = MALFORMED[variant]
    with pytest.raises(FixtureError) as info:
        load_fixture(mutate(_committed_entry(VALUE)))
    assert all(word in str(info.value) for word in words)


def test_error_entry_with_gradients_is_refused(tmp_path):
    entry = _committed_entry(ERROR)
    entry["wrt"] = ["lengths"]
    with pytest.raises(FixtureError, match=r"'wrt'"):
        load_fixture(entry, _folder(tmp_path, [entry]))


def test_duplicate_case_names_are_refused_after_the_first(tmp_path):
    first, second = _committed_entry(VALUE), _committed_entry(VALUE)
    broken, loaded = _problems(_folder(tmp_path, [first, second]))
    assert loaded == [VALUE]
    assert "duplicate" in broken[VALUE] and "'name'" in broken[VALUE]


def test_catalog_names_and_files_follow_the_manifest_rules():
    for case in CASES:
        assert CASE_NAME.fullmatch(case.name), case.name
        assert fixtures_module._FILE.fullmatch(case_file(case.name)), case.name


# --------------------------------------------------------------------------
# the file: nothing outside the folder, nothing but a small regular file


def _entry_for(tmp_path, filename):
    entry = _committed_entry(VALUE)
    entry["file"] = filename
    return entry, _folder(tmp_path, [entry])


def test_symlink_to_dev_zero_is_refused_unread(tmp_path):
    entry, folder = _entry_for(tmp_path, "zero.npz")
    os.symlink("/dev/zero", folder / "zero.npz")
    with pytest.raises(FixtureError, match=r"sdpa/cross/none: fixture file zero.npz is a symbolic link"):
        load_fixture(entry, folder)


def test_symlink_to_a_valid_fixture_outside_the_folder_is_refused(tmp_path):
    entry, folder = _entry_for(tmp_path, "outside.npz")
    os.symlink(DEFAULT_DIR / case_file(VALUE), folder / "outside.npz")
    with pytest.raises(FixtureError, match="symbolic link"):
        load_fixture(entry, folder)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path):
    entry, folder = _entry_for(tmp_path, "pipe.npz")
    os.mkfifo(folder / "pipe.npz")
    with pytest.raises(FixtureError, match="not a regular file"):
        load_fixture(entry, folder)


def test_directory_in_place_of_a_file_is_refused(tmp_path):
    entry, folder = _entry_for(tmp_path, "dir.npz")
    (folder / "dir.npz").mkdir()
    with pytest.raises(FixtureError, match="not a regular file"):
        load_fixture(entry, folder)


def test_file_over_the_size_cap_is_refused_before_reading(tmp_path, monkeypatch):
    assert MAX_FILE_BYTES == 64 * 2**20
    entry, folder = _entry_for(tmp_path, case_file(VALUE))
    monkeypatch.setattr(fixtures_module, "MAX_FILE_BYTES", 1000)
    with pytest.raises(FixtureError, match=r"over the 1000-byte cap"):
        load_fixture(entry, folder)


def test_manifest_symlinked_to_dev_zero_is_a_manifest_error(tmp_path):
    folder = tmp_path / "fixtures"
    folder.mkdir()
    os.symlink("/dev/zero", folder / "manifest.json")
    with pytest.raises(ManifestError, match="symbolic link"):
        load_manifest(folder)


def test_deeply_nested_manifest_is_a_manifest_error(tmp_path):
    folder = tmp_path / "fixtures"
    folder.mkdir()
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match="unreadable manifest"):
        load_manifest(folder)


# --------------------------------------------------------------------------
# .npz members: checked against the manifest before any array data is read


def _committed_arrays(name=VALUE):
    with np.load(DEFAULT_DIR / case_file(name)) as npz:
        return {k: npz[k] for k in npz.files}


def _npy(array=None, *, header=None, data=None):
    """The bytes of one ``.npy`` member; ``header`` overrides what the header says."""
    body = io.BytesIO()
    if header is None:
        np.lib.format.write_array(body, array, allow_pickle=False)
        return body.getvalue()
    np.lib.format.write_array_header_1_0(body, header)
    return body.getvalue() + (data if data is not None else b"")


def _write_members(tmp_path, members):
    """A folder whose VALUE case is the zip of ``{member name: bytes}``, its sha256 in the manifest."""
    entry = _committed_entry(VALUE)
    folder = _folder(tmp_path, [entry], files=())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, body in members.items():
            zf.writestr(name, body)
    (folder / entry["file"]).write_bytes(buffer.getvalue())
    entry["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(
        {"format": fixtures_module.FORMAT, "spec_version": numpy_ref.SPEC_VERSION, "cases": [entry]}))
    return entry, folder


def _members(**changes):
    members = {f"{k}.npy": _npy(a) for k, a in _committed_arrays().items()}
    for key, body in changes.items():
        key = key.replace("__", "/") + ".npy"
        if body is None:
            del members[key]
        else:
            members[key] = body
    return members


def test_committed_members_rezipped_still_load(tmp_path):
    entry, folder = _write_members(tmp_path, _members())
    fixture = load_fixture(entry, folder)
    np.testing.assert_array_equal(fixture.outputs["out"], _committed_arrays()["out/out"])


def test_member_with_the_wrong_shape_in_its_header_is_rejected_before_its_data_is_read(tmp_path, monkeypatch):
    # the header claims 8 GB and no data follows: reading it would fail otherwise
    header = {"descr": "<f8", "fortran_order": False, "shape": (1000, 1000, 1000)}
    entry, folder = _write_members(tmp_path, _members(in__q=_npy(header=header)))
    reads = []
    real = np.lib.format.read_array
    monkeypatch.setattr(np.lib.format, "read_array", lambda *a, **k: reads.append(a) or real(*a, **k))
    with pytest.raises(FixtureError) as info:
        load_fixture(entry, folder)
    assert "in/q: header says float64[1000, 1000, 1000], the manifest says float64[2, 3, 5, 4]" in str(info.value)
    assert reads == []


def test_member_of_object_dtype_is_refused_unread(tmp_path, monkeypatch):
    header = {"descr": "|O", "fortran_order": False, "shape": (2, 3, 5, 4)}
    entry, folder = _write_members(tmp_path, _members(in__q=_npy(header=header, data=b"\x80\x04junk")))
    monkeypatch.setattr(np.lib.format, "read_array", lambda *a, **k: pytest.fail("data read"))
    with pytest.raises(FixtureError, match=r"in/q: dtype \|O refused"):
        load_fixture(entry, folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"out__weights": None}, "has no array 'out/weights'"),
        ({"grad__q": None}, "has no array 'grad/q'"),
        ({"in__extra": _npy(np.zeros(2))}, "unexpected member 'in/extra.npy'"),
        ({"grad__q": _npy(np.zeros((2, 3, 5, 4), dtype=np.int64))}, "grad/q: dtype <i8 refused"),
        ({"out__out": _npy(np.array(["a", "b"]))}, "out/out: dtype <U1 refused"),
        ({"cot__out": _npy(np.zeros((2, 3, 5, 5)))}, "cot/out: shape [2, 3, 5, 5], but out/out is [2, 3, 5, 6]"),
        ({"grad_out_only__k": _npy(np.zeros((2, 3, 7, 5)))}, "grad_out_only/k: header says float64[2, 3, 7, 5]"),
        ({"in__v": _npy(np.zeros((2, 3, 7, 6), dtype=np.float32))}, "in/v: dtype <f4 refused"),
        ({"in__q": _npy(header={"descr": "<f8", "fortran_order": False, "shape": (2, 3, 5, 4)}, data=b"\0" * 8)},
         "in/q: member is"),
    ],
    ids=["missing output", "missing gradient", "extra member", "int gradient", "string output",
         "cotangent shape", "gradient shape", "input dtype", "truncated data"],
)
def test_npz_members_disagreeing_with_the_manifest_are_refused(tmp_path, changes, message):
    entry, folder = _write_members(tmp_path, _members(**changes))
    with pytest.raises(FixtureError) as info:
        load_fixture(entry, folder)
    assert message in str(info.value) and str(info.value).startswith(f"{VALUE}: {entry['file']}: ")


def test_a_file_read_again_is_not_parsed_again_and_its_arrays_are_fresh_copies(tmp_path, tmp_path_factory, monkeypatch):
    """``_read_npz`` keeps what it parsed, keyed by the bytes' digest: the same file
    read twice is parsed once and each read gets its own writable arrays (a caller
    that changes one changes nothing the next read sees); a file whose bytes changed
    is parsed again and gives its new values; a refused file is refused every time."""
    monkeypatch.setattr(fixtures_module, "_READ", fixtures_module._Recent(2**30, fixtures_module._READ.size_of))
    parses = []
    real = fixtures_module._parse_npz
    monkeypatch.setattr(fixtures_module, "_parse_npz", lambda *a: parses.append(a[2]) or real(*a))
    entry, folder = _write_members(tmp_path, _members())
    first = load_fixture(entry, folder)
    first.outputs["out"][...] = 7.0
    second = load_fixture(entry, folder)
    assert len(parses) == 1
    np.testing.assert_array_equal(second.outputs["out"], _committed_arrays()["out/out"])

    changed = _committed_arrays()["out/out"] * 2
    entry, folder = _write_members(tmp_path_factory.mktemp("changed"), _members(out__out=_npy(changed)))
    np.testing.assert_array_equal(load_fixture(entry, folder).outputs["out"], changed)
    assert len(parses) == 2

    header = {"descr": "|O", "fortran_order": False, "shape": (2, 3, 5, 4)}
    entry, folder = _write_members(tmp_path_factory.mktemp("refused"), _members(in__q=_npy(header=header)))
    for _ in range(2):
        with pytest.raises(FixtureError, match="in/q: dtype |O refused"):
            load_fixture(entry, folder)
    assert len(parses) == 4


def test_an_encoding_is_reused_only_for_the_same_names_dtypes_shapes_and_bytes():
    """``_npz_bytes`` keeps its recent answers; the same bytes under another name,
    shape or dtype are another file."""
    a = np.arange(6.0)
    first = fixtures_module._npz_bytes({"x": a})
    assert first == fixtures_module._npz_bytes({"x": a.copy()}) == fixtures_module._deflated_npz({"x": a})
    others = [{"y": a}, {"x": a.reshape(2, 3)}, {"x": a.view(np.int64)}, {"x": a, "z": a}]
    encoded = [fixtures_module._npz_bytes(arrays) for arrays in others]
    assert len({first, *encoded}) == 1 + len(others)
    for arrays, data in zip(others, encoded):
        with np.load(io.BytesIO(data)) as npz:
            assert {k: (npz[k].dtype, npz[k].shape) for k in npz.files} == {
                k: (v.dtype, v.shape) for k, v in arrays.items()}


def test_the_files_kept_stay_within_their_byte_budget_least_recently_used_out(tmp_path, monkeypatch):
    """Over the budget, the file read longest ago is dropped (and parsed again
    when read again); a file larger than the whole budget is read but never kept."""
    monkeypatch.setattr(fixtures_module, "_READ", fixtures_module._Recent(2**30, fixtures_module._READ.size_of))
    parses = []
    real = fixtures_module._parse_npz
    monkeypatch.setattr(fixtures_module, "_parse_npz", lambda *a: parses.append(a[2]) or real(*a))
    read = {}
    for name in ("a", "b", "c"):  # 3 files of 800 bytes
        data = fixtures_module._npz_bytes({"x": np.full(100, ord(name), dtype=np.float64)})
        read[name] = lambda data=data, name=name: fixtures_module._read_npz(
            data, {"x": ((100,), frozenset({"float64"}), None)}, name)
    monkeypatch.setattr(fixtures_module._READ, "budget", 2000)  # room for two
    read["a"](), read["b"](), read["a"](), read["c"]()  # c pushes out b, read longest ago
    assert parses == ["a", "b", "c"] and fixtures_module._READ.size == 1600
    read["a"](), read["b"]()
    assert parses == ["a", "b", "c", "b"]
    monkeypatch.setattr(fixtures_module._READ, "budget", 700)  # no file fits
    assert read["c"]()["x"][0] == ord("c") and read["c"]()["x"][0] == ord("c")
    assert parses == ["a", "b", "c", "b", "c", "c"]
