"""JAX's persistent compilation cache for the main command (conformance/xla.py):
in the user's cache directory, never inside the package, off by flag or variable,
never for a third party's backend."""
import os

import pytest

from conformance import xla
from conformance.__main__ import _parser

PACKAGE = os.path.dirname(os.path.abspath(xla.__file__))


@pytest.fixture
def env(monkeypatch, tmp_path):
    for name in ("JAX_COMPILATION_CACHE_DIR", xla.NO_CACHE_ENV, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_the_folder_is_under_xdg_cache_home(env):
    path = xla.use_compilation_cache()
    assert path == str(env / "cache" / "attention-spec" / "jax") and os.path.isdir(path)
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == path
    assert os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert not path.startswith(PACKAGE)


def test_without_xdg_it_is_home_dot_cache(env, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(env / "home"))
    assert xla.compilation_cache_dir() == str(env / "home" / ".cache" / "attention-spec" / "jax")


@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_variable_turns_it_off(env, monkeypatch, value):
    monkeypatch.setenv(xla.NO_CACHE_ENV, value)
    assert xla.use_compilation_cache() is None
    assert "JAX_COMPILATION_CACHE_DIR" not in os.environ


def test_a_users_own_cache_folder_is_kept(env, monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(env / "mine"))
    assert xla.use_compilation_cache() == str(env / "mine")
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(env / "mine")


def test_an_unwritable_cache_home_runs_without_it(env, monkeypatch):
    blocker = env / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert xla.use_compilation_cache() is None


def test_the_flag_exists_and_defaults_off():
    assert _parser().parse_args([]).no_compile_cache is False
    assert _parser().parse_args(["--no-compile-cache"]).no_compile_cache is True


@pytest.mark.parametrize("argv, allowed", [
    ([], True),
    (["--backend", "jax", "--backend", "torch"], True),
    (["--no-compile-cache"], False),
    (["--backend", "jax", "--backend", "conformance.examples.my_attention_backend:MyBackend"], False),
])
def test_a_third_party_backend_never_runs_with_the_cache(argv, allowed):
    from conformance.__main__ import _may_cache

    assert _may_cache(_parser().parse_args(argv)) is allowed
