"""Fixtures shared by the conformance tests."""
import shutil

import pytest

from conformance.fixtures import DEFAULT_DIR


@pytest.fixture
def fixtures_copy(tmp_path):
    """A private copy of the committed fixtures, to damage or regenerate."""
    target = tmp_path / "fixtures"
    shutil.copytree(DEFAULT_DIR, target)
    return target
