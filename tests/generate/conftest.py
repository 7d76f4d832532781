import pytest
import torch


@pytest.fixture(scope="session")
def models() -> dict[str, torch.nn.Module]:
    """The compiled-step test models (tests/generate/test_compiled.py), compiled once for the session."""
    from tests.generate.test_compiled import compiled_models

    return compiled_models()


@pytest.fixture(scope="module")
def own_inductor_cache(tmp_path_factory):
    """Inductor's cache in a temporary directory for the module's tests, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield
