import pytest
import torch


@pytest.fixture(scope="session")
def models() -> dict[str, torch.nn.Module]:
    """The compiled-step test models (tests/generate/test_compiled.py), compiled once for the session."""
    from tests.generate.test_compiled import compiled_models

    return compiled_models()
