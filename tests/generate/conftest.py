import os

import pytest
import torch


@pytest.fixture(scope="session")
def models() -> dict[str, torch.nn.Module]:
    """The compiled-step test models (tests/generate/test_compiled.py), compiled once for the session."""
    from tests.generate.test_compiled import compiled_models

    return compiled_models()


@pytest.fixture(scope="module")
def own_inductor_cache():
    """Inductor's cache for the module's tests in the run's temporary directory (tests/conftest.py), not the
    user's: shared by the test files and workers of one run, so that a graph two files compile is built once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ["QKV_TEST_INDUCTOR"])
        yield
