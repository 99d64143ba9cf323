"""The experiments set torch's global state for their runs (one CPU thread, a default
dtype): a test that runs one in this process puts it back afterwards, so the rest of
the session runs as it would have."""
import pytest

try:
    import torch
except ImportError:  # a numpy-only install
    torch = None

_SESSION = None if torch is None else (torch.get_num_threads(), torch.get_default_dtype())


@pytest.fixture(autouse=True)
def _restore_torch_state():
    yield
    if torch is not None:
        threads, dtype = _SESSION
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
