"""The served tiny decoder shared by tests/serve/test_server.py and test_app.py: one live `qkv serve` per
package run (a subprocess on 127.0.0.1), its run dir and the same run loaded in-process."""
import pytest

import qkv
from tests.serve.live import Live, write_run


@pytest.fixture(scope="package")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="package")
def live(run_dir):
    with Live(run_dir, max_batch=16) as server:
        yield server


@pytest.fixture(scope="package")
def run(run_dir):
    return qkv.load(run_dir)
