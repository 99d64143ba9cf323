"""The suite's power: every realistic single bug fails the float64 conformance run.

Each mutant of ``tests/conformance/mutants.py`` is the numpy reference with
one function swapped. It must fail the committed fixtures in float64, and
the cases its docstring-level reasoning names (``catches``) must be among
the failures, so a catalog change that loses a catch fails here by name.
The cases the same reasoning says cannot see the bug (``spares``) must
pass, which checks that the reasoning, not luck, picked the catching cases.

Mutants that no case of today's catalog catches are kept, marked
``xfail(strict=True)`` with the reason: a new case that catches one turns
the xfail into a failure, and the mark is then removed.

``python -m tests.conformance.mutants`` prints the whole table.
"""
from __future__ import annotations

import pytest

import numpy_ref
from conformance.backends.numpy_backend import NumpyBackend
from conformance.runner import Session, load_all

from ..tiers import SLOW
from .mutants import MUTANTS, MUTANTS_BY_NAME, backend_class, catch_table, failing, swapped


def _params():
    for m in MUTANTS:
        marks = [pytest.mark.xfail(strict=True, reason=f"no case catches it: {m.escape}")] if m.escape else []
        yield pytest.param(m.name, marks=marks, id=m.name)


def _caught():
    return [m.name for m in MUTANTS if not m.escape]


def test_the_reference_itself_passes_every_case():
    """The baseline: with nothing swapped, every failure below is the mutant's."""
    fixtures, broken = load_all()
    assert not broken
    with Session(NumpyBackend()) as session:
        failed = [f.name for f in fixtures
                  if (session.value(f, "float64") if f.call.expect_error is None else session.error(f)).status == "fail"]
    assert failed == []


def test_there_are_at_least_30_mutants_over_every_kind_of_bug():
    families = {m.family for m in MUTANTS}
    assert len(MUTANTS) >= 30
    assert {"scale", "mask", "softmax", "layer_norm", "positional", "dropout", "heads", "projection",
            "grad", "activation", "encoder", "dtype"} <= families


@pytest.mark.parametrize("name", _caught())
def test_mutant_fails_its_catching_cases_and_passes_its_spared_ones(name):
    """The fast tier's power check: only the cases the reasoning names are run
    (a few per mutant instead of the whole catalog)."""
    mutant = MUTANTS_BY_NAME[name]
    named = mutant.catches | mutant.spares
    failed = failing(name, only=frozenset(named))
    missed = sorted(mutant.catches - failed.keys())
    assert not missed, f"{name}: expected these cases to catch it, they pass: {missed}"
    wrongly = {c: failed[c] for c in mutant.spares if c in failed}
    assert not wrongly, f"{name}: cases that cannot see the bug fail: {wrongly}"


# the whole float64 catalog per mutant, ~1.5 s each (an escape is only shown to escape
# by every case passing): the slow tier, which .ci/run runs
@SLOW
@pytest.mark.parametrize("name", list(_params()))
def test_mutant_fails_the_named_cases(name):
    mutant = MUTANTS_BY_NAME[name]
    failed = failing(name)
    assert failed, f"{name} ({mutant.bug}) passes every case"
    missed = sorted(mutant.catches - failed.keys())
    assert not missed, f"{name}: expected these cases to catch it, they pass: {missed}"
    wrongly = {c: failed[c] for c in mutant.spares if c in failed}
    assert not wrongly, f"{name}: cases that cannot see the bug fail: {wrongly}"


def test_every_caught_mutant_names_its_catching_cases():
    """A catch is stated, not only observed: no caught mutant with an empty ``catches``."""
    assert [m.name for m in MUTANTS if not m.escape and not m.catches] == []
    assert [m.name for m in MUTANTS if m.escape and m.catches] == []


def test_a_swap_is_undone_after_the_run():
    original = numpy_ref.attention.apply_dropout
    with swapped("_ops.apply_dropout", lambda orig: lambda x, keep, p: x):
        assert numpy_ref.attention.apply_dropout is not original  # imported by name: replaced there too
        assert numpy_ref.layers.apply_dropout is numpy_ref.attention.apply_dropout
    assert numpy_ref.attention.apply_dropout is original and numpy_ref.layers.apply_dropout is original


def test_a_mutant_backend_is_a_conformance_backend():
    """It runs through the public runner like any adapter, named after its bug."""
    cls = backend_class(MUTANTS_BY_NAME["scale/ignored-when-given"])
    fixtures, _ = load_all(select="sdpa/cross/scale or sdpa/cross/none")
    with Session(cls()) as session:
        status = {f.name: session.value(f, "float64").status for f in fixtures}
    # -k matches substrings: sdpa/cross/scale0 is selected too, and an ignored scale 0 fails it
    assert status == {"sdpa/cross/scale": "fail", "sdpa/cross/scale0": "fail", "sdpa/cross/none": "pass"}
    assert cls.name == "mutant-scale-ignored-when-given"


@SLOW  # every mutant over the whole catalog (shares failing()'s cache with the test above)
def test_family_table_counts_every_caught_mutant(capsys):
    rows = catch_table(level=1)
    caught = [m for m in MUTANTS if failing(m.name)]
    # every caught mutant is counted in at least one family, none in more families than exist
    assert sum(n for _, n, _ in rows) >= len(caught)
    assert all(0 <= n <= len(MUTANTS) for _, n, _ in rows)
    by_family = {fam: n for fam, n, _ in rows}
    sdpa_caught = sum(1 for m in MUTANTS if any(c.startswith("sdpa/") for c in failing(m.name)))
    assert by_family["sdpa"] == sdpa_caught
    with capsys.disabled():  # the short table; `python -m tests.conformance.mutants` prints it all
        print(f"\n{'case family':<16} mutants caught / cases")
        print("\n".join(f"  {fam:<14} {n:>3} / {cases}" for fam, n, cases in rows))
