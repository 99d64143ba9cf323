"""``python -m conformance generate``: a folder it owns, only real changes written, --check."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from conformance.__main__ import main
from conformance.catalog import CASES
from conformance.fixtures import DEFAULT_DIR, case_file, load_fixture, load_manifest, save_npz
from conformance.generate import NOISE_RTOL, FolderError, generate, manifest_text

from ..tiers import first_of_each

# generating fixtures computes numpy_ref's bfloat16 reference errors, which needs ml_dtypes
pytest.importorskip("ml_dtypes")

VALUE = "sdpa/cross/none"  # a value case with gradients and two outputs
OTHER = "mha/self/causal"


def _snapshot(folder):
    """``{relative path: (bytes, mtime_ns)}`` of everything under ``folder`` (hidden files too)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            st = os.lstat(path)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[rel] = (f.read(), st.st_mtime_ns)
            else:
                out[rel] = ("dir",)
    return out


@pytest.fixture(scope="module", autouse=True)
def computed_once():
    """Each case's fixture is computed once per test module, not once per test.

    These tests check what ``generate`` does with a folder (what it keeps, writes,
    refuses, removes); the arrays it writes are ``build_fixture``'s, a pure
    function of the case that nothing here changes (a case is a frozen
    description, numpy_ref is not patched). So the first test that builds a case
    runs the real computation, and later ones get a copy of its result: about
    3 s per regeneration of the catalog saved, a dozen times. A case that fails
    to build raises every time (a failure is never kept).
    """
    import copy

    import conformance.generate as G

    real, kept = G.build_fixture, {}

    def build_fixture(case, reference_dtypes=G.REFERENCE_DTYPES):
        key = (id(case), tuple(reference_dtypes))
        if key not in kept:
            kept[key] = (case, real(case, reference_dtypes))  # the case held: its id stays its own
        return copy.deepcopy(kept[key][1])

    G.build_fixture = build_fixture
    yield
    G.build_fixture = real


@pytest.fixture
def folder(fixtures_copy):
    """A private copy of the committed fixtures (tests/conformance/conftest.py)."""
    return fixtures_copy


def _cli(capsys, *argv):
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def _perturb(folder, name, key, relative):
    """Move ``key`` of case ``name`` by ``relative`` x its max magnitude; keep the manifest consistent.

    Returns the new bytes of the file.
    """
    path = folder / case_file(name)
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    a = arrays[key]
    arrays[key] = a + relative * np.max(np.abs(a)) * np.sign(a)
    sha = save_npz(path, arrays)
    manifest = _manifest(folder)
    for entry in manifest["cases"]:
        if entry["name"] == name:
            entry["sha256"] = sha
    (folder / "manifest.json").write_text(manifest_text(manifest))
    return path.read_bytes()


# --------------------------------------------------------------------------
# a folder it owns


@pytest.mark.parametrize(
    "contents",
    [
        {"notes.txt": "mine"},
        {"data.npz": "not ours either"},
        {"manifest.json": '{"name": "my web app", "icons": []}'},
        {"manifest.json": "not json at all"},
        {".hidden": ""},
    ],
    ids=["a text file", "an npz", "someone else's manifest.json", "a broken manifest.json", "a hidden file"],
)
def test_generate_refuses_a_non_empty_folder_without_our_manifest_and_writes_nothing(tmp_path, capsys, contents):
    target = tmp_path / "theirs"
    target.mkdir()
    for name, text in contents.items():
        (target / name).write_text(text)
    before = _snapshot(target)
    code, out, err = _cli(capsys, "--out", str(target))
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "refusing to write" in err and str(target) in err
    assert out == ""
    assert _snapshot(target) == before


def test_generate_refuses_a_file_as_its_folder(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("mine")
    code, _, err = _cli(capsys, "--out", str(target))
    assert code == 2 and "not a directory" in err
    assert target.read_text() == "mine"


def test_generate_fills_a_new_folder_then_rewrites_nothing(tmp_path, capsys):
    target = tmp_path / "new" / "fixtures"
    first = generate(target)
    assert first.written == [c.name for c in CASES] and first.kept == [] and first.manifest_changed
    assert len(first.changes) == len(CASES) and all(line.startswith("missing ") for line in first.changes)
    before = _snapshot(target)
    code, out, _ = _cli(capsys, "--out", str(target))
    assert code == 0
    assert f"wrote 0, kept {len(CASES)} (all bit-identical), removed 0 stale; manifest unchanged" in out
    assert _snapshot(target) == before


def test_generate_writes_into_an_empty_folder(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    report = generate(target, cases=[c for c in CASES if c.name == VALUE])
    assert report.written == [VALUE]
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json", case_file(VALUE)]


def test_regenerating_the_committed_fixtures_keeps_every_file_byte_for_byte(folder):
    before = _snapshot(folder)
    report = generate(folder)
    assert report.written == [] and report.removed == [] and not report.manifest_changed
    assert report.kept == [c.name for c in CASES] and report.clean
    assert _snapshot(folder) == before


def test_a_users_own_files_survive_a_regenerate(folder):
    mine = {"mine.npz": b"user data", "notes.txt": b"notes", "sdpa__cross__mine.npz": b"looks like ours"}
    for name, data in mine.items():
        (folder / name).write_bytes(data)
    (folder / "sub").mkdir()
    (folder / "sub" / "x.npz").write_bytes(b"nested")
    dropped = CASES[-1]
    report = generate(folder, cases=CASES[:-1])  # the last case is no longer a case: stale
    assert report.removed == [case_file(dropped.name)]
    assert f"stale {dropped.name}: no longer a case" in report.changes
    assert not (folder / case_file(dropped.name)).exists()
    for name, data in mine.items():
        assert (folder / name).read_bytes() == data
    assert (folder / "sub" / "x.npz").read_bytes() == b"nested"


def test_stale_removal_is_limited_to_the_files_the_old_manifest_lists(tmp_path, folder):
    outside = tmp_path / "outside.npz"
    outside.write_bytes(b"outside the folder")
    manifest = _manifest(folder)
    template = next(e for e in manifest["cases"] if e["name"] == VALUE)
    listed = dict(template, name="sdpa/old/gone", file="sdpa__old__gone.npz")
    escaping = dict(template, name="sdpa/old/escaping", file="../outside.npz")
    manifest["cases"] += [listed, escaping]
    (folder / "manifest.json").write_text(manifest_text(manifest))
    (folder / "sdpa__old__gone.npz").write_bytes(b"listed: ours")
    (folder / "sdpa__old__unlisted.npz").write_bytes(b"not listed: a user's")

    report = generate(folder)
    assert report.removed == ["sdpa__old__gone.npz"]
    assert not (folder / "sdpa__old__gone.npz").exists()
    assert (folder / "sdpa__old__unlisted.npz").read_bytes() == b"not listed: a user's"
    assert outside.read_bytes() == b"outside the folder"
    assert {"stale sdpa/old/gone: no longer a case", "stale sdpa/old/escaping: no longer a case"} <= set(report.changes)
    assert [e["name"] for e in _manifest(folder)["cases"]] == [c.name for c in CASES]


def test_a_file_the_manifest_does_not_list_is_not_overwritten(folder, capsys):
    manifest = _manifest(folder)
    manifest["cases"] = [e for e in manifest["cases"] if e["name"] != VALUE]
    (folder / "manifest.json").write_text(manifest_text(manifest))
    (folder / case_file(VALUE)).write_bytes(b"a user's file under a case's name")
    before = _snapshot(folder)
    code, _, err = _cli(capsys, "--out", str(folder))
    assert code == 2 and "not ours" in err and case_file(VALUE) in err
    assert _snapshot(folder) == before


def test_an_unlisted_file_equal_to_the_case_is_adopted_not_rewritten(folder):
    # what an interrupted run leaves: the new file written, the manifest not yet
    manifest = _manifest(folder)
    manifest["cases"] = [e for e in manifest["cases"] if e["name"] != VALUE]
    (folder / "manifest.json").write_text(manifest_text(manifest))
    data = (folder / case_file(VALUE)).read_bytes()
    report = generate(folder)
    assert VALUE in report.kept and report.written == []
    assert f"manifest {VALUE}: not listed in manifest.json" in report.changes
    assert (folder / case_file(VALUE)).read_bytes() == data
    assert generate(folder, check=True).clean


def test_a_symlink_at_a_case_path_is_replaced_not_written_through(tmp_path, folder):
    outside = tmp_path / "outside.npz"
    outside.write_bytes(b"outside the folder")
    path = folder / case_file(VALUE)
    committed = path.read_bytes()
    path.unlink()
    os.symlink(outside, path)
    report = generate(folder)
    assert report.written == [VALUE]
    assert outside.read_bytes() == b"outside the folder"
    assert not path.is_symlink() and path.read_bytes() == committed


def test_a_failing_case_writes_nothing(tmp_path):
    good = next(c for c in CASES if c.name == VALUE)
    bad = dataclasses.replace(next(c for c in CASES if c.error), error=("KeyError", "nothing"))
    target = tmp_path / "new"
    with pytest.raises(RuntimeError, match="fixture generation failed"):
        generate(target, cases=[good, bad])
    assert not target.exists()


def test_folder_error_is_a_runtime_error_for_old_callers():
    assert issubclass(FolderError, RuntimeError)


# --------------------------------------------------------------------------
# the noise floor


@pytest.fixture(scope="module")
def machine_noise(tmp_path_factory):
    """The cases this machine's BLAS computes to other bits than the committed ones
    (all within the floor): none on the kernel that wrote the fixtures, about a third
    of the catalog on another (OpenBLAS's Zen kernel against its Haswell one, float64
    moving by ~1e-16 relative). The floor exists for exactly this; a test must not
    assume the machine it runs on wrote the fixtures."""
    copy = tmp_path_factory.mktemp("noise") / "fixtures"
    shutil.copytree(DEFAULT_DIR, copy)
    report = generate(copy, check=True)
    assert report.clean and report.written == [] and report.worst <= 1, report.changes
    return set(report.noisy)


# the first key of each sweep is the fast tier's (tests/tiers.py); the other kinds of array, slow
@pytest.mark.parametrize("key", first_of_each(["out/out", "grad/q", "grad_out_only/v"]))
def test_an_array_moved_by_1e_15_relative_is_kept_byte_for_byte(folder, capsys, key, machine_noise):
    perturbed = _perturb(folder, VALUE, key, 1e-15)
    assert perturbed != (DEFAULT_DIR / case_file(VALUE)).read_bytes()
    before = _snapshot(folder)
    report = generate(folder)
    noisy = machine_noise | {VALUE}
    assert report.written == [] and set(report.noisy) == noisy and len(report.noisy) == len(noisy)
    assert 0 < report.worst <= 1
    assert report.clean
    assert _snapshot(folder) == before
    code, out, _ = _cli(capsys, "--check", "--out", str(folder))
    assert code == 0 and f"{len(noisy)} within the noise floor" in out


@pytest.mark.parametrize("key", first_of_each(["out/out", "grad/q", "out/weights"]))
def test_an_array_moved_by_1e_6_relative_fails_check_and_is_rewritten(folder, capsys, key):
    _perturb(folder, VALUE, key, 1e-6)
    before = _snapshot(folder)
    code, out, _ = _cli(capsys, "--check", "--out", str(folder))
    assert code == 1
    assert out.splitlines() == [next(line for line in out.splitlines() if line.startswith(f"differs {VALUE}: {key}"))]
    assert _snapshot(folder) == before

    report = generate(folder)
    assert report.written == [VALUE] and report.manifest_changed
    assert (folder / case_file(VALUE)).read_bytes() == (DEFAULT_DIR / case_file(VALUE)).read_bytes()
    assert (folder / "manifest.json").read_bytes() == (DEFAULT_DIR / "manifest.json").read_bytes()


def test_an_input_changed_by_one_ulp_is_rewritten(folder):
    path = folder / case_file(VALUE)
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["in/q"] = np.nextafter(arrays["in/q"], np.inf)
    save_npz(path, arrays)
    report = generate(folder, check=True)
    assert report.written == [VALUE]
    assert any(line.startswith(f"differs {VALUE}: in/q changed") for line in report.changes)


def test_the_floor_is_the_documented_one():
    assert NOISE_RTOL == 1e-12


# --------------------------------------------------------------------------
# --check


def test_check_passes_on_the_committed_fixtures_and_writes_nothing(capsys):
    before = _snapshot(DEFAULT_DIR)
    code, out, err = _cli(capsys, "--check")
    assert code == 0, out + err
    assert out.startswith(f"ok: {DEFAULT_DIR} matches the {len(CASES)} cases")
    assert _snapshot(DEFAULT_DIR) == before


def test_check_fails_on_a_damaged_copy_and_leaves_it_byte_for_byte_unchanged(folder, capsys):
    _perturb(folder, VALUE, "out/out", 1e-6)
    (folder / case_file(OTHER)).unlink()
    manifest = _manifest(folder)
    extra = dict(manifest["cases"][0], name="masks/old/gone", file="masks__old__gone.npz")
    manifest["cases"].append(extra)
    manifest["cases"][1]["note"] = "edited"
    (folder / "manifest.json").write_text(manifest_text(manifest))
    (folder / "masks__old__gone.npz").write_bytes(b"stale")
    before = _snapshot(folder)

    code, out, err = _cli(capsys, "--check", "--out", str(folder))
    assert code == 1
    lines = out.splitlines()
    assert any(line.startswith(f"differs {VALUE}: out/out moved by") for line in lines)
    assert f"missing {OTHER}: no file {case_file(OTHER)}" in lines
    assert "stale masks/old/gone: no longer a case" in lines
    assert f"manifest {manifest['cases'][1]['name']}: entry differs in note" in lines
    assert len(lines) == 4, out
    assert "FAILED" in err
    assert _snapshot(folder) == before


def test_check_on_a_missing_folder_fails_and_creates_nothing(tmp_path, capsys):
    target = tmp_path / "nowhere"
    code, out, _ = _cli(capsys, "--check", "--out", str(target))
    assert code == 1 and out.count("\nmissing ") == len(CASES) - 1
    assert not target.exists()


def test_check_refuses_a_folder_it_does_not_own(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = _cli(capsys, "--check", "--out", str(tmp_path))
    assert code == 2 and "refusing" in err


def test_generated_folder_loads_and_matches_its_manifest(tmp_path):
    report = generate(tmp_path / "f", cases=CASES[:20])
    manifest = load_manifest(tmp_path / "f")
    assert manifest["cases"] == report.manifest["cases"]
    for entry in manifest["cases"]:
        data = (tmp_path / "f" / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        load_fixture(entry, tmp_path / "f")
