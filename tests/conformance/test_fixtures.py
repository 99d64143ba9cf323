"""The catalog and the committed fixtures: coverage, size, and reproducibility."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import numpy_ref
from conformance.cases import CASES, COMPONENTS, cases, component
from conformance.fixtures import DEFAULT_DIR, generate, load_fixture, load_manifest
from conformance.protocol import flatten

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
        assert set(call.wrt) == floats, case.name
        assert bool(call.cotangents) == bool(call.wrt), case.name


def test_manifest_matches_the_catalog_and_the_spec_version():
    manifest = load_manifest()
    assert manifest["spec_version"] == numpy_ref.SPEC_VERSION
    assert [e["name"] for e in manifest["cases"]] == [c.name for c in CASES]
    for entry, case in zip(manifest["cases"], CASES):
        assert entry["tolerance"] == case.tolerance
        assert (entry["error"] or {}).get("arg") == (case.error[1] if case.error else None)


def test_fixtures_stay_small():
    total = sum(p.stat().st_size for p in DEFAULT_DIR.iterdir())
    assert total < 5 * 2**20, f"{total / 2**20:.1f} MiB"


def test_regenerated_fixtures_agree_with_the_committed_copies(tmp_path):
    fresh = generate(tmp_path)
    committed = load_manifest()
    strip = ("sha256",)
    assert [{k: v for k, v in e.items() if k not in strip} for e in fresh["cases"]] == [
        {k: v for k, v in e.items() if k not in strip} for e in committed["cases"]
    ]
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
