"""conformance.xla: the compile-speed flags the command and the tests give JAX."""
import pytest

from conformance import xla


def test_adds_the_missing_flags_and_leaves_the_users_own(monkeypatch):
    monkeypatch.setattr(xla, "_known_to_jaxlib", lambda names: set(names))
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    added = xla.use_fast_compile()
    assert "--xla_backend_optimization_level=0" not in added  # the user's setting stands
    assert added == [f"--{n}={v}" for n, v in xla.XLA_FAST_COMPILE.items() if n != "xla_backend_optimization_level"]
    flags = xla.os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_backend_optimization_level=2" and flags[1:] == added
    assert xla.use_fast_compile() == []  # idempotent


def test_a_flag_this_jaxlib_does_not_know_is_not_set(monkeypatch):
    """XLA aborts the process on an unknown flag."""
    monkeypatch.setattr(xla, "_known_to_jaxlib", lambda names: {"xla_cpu_use_fusion_emitters"} & set(names))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert xla.use_fast_compile() == ["--xla_cpu_use_fusion_emitters=false"]


def test_the_flags_are_known_to_the_installed_jaxlib():
    pytest.importorskip("jaxlib")
    assert xla._known_to_jaxlib(list(xla.XLA_FAST_COMPILE)) == set(xla.XLA_FAST_COMPILE)
