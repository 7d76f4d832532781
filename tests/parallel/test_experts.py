"""Expert parallel (qkv.parallel.experts) at the layer: two gloo ranks, each with half the experts of an MoE
layer and half the batch, against the whole layer on the whole batch in one process (tests/parallel/
expert_worker.py): outputs, input gradients, each expert's gradient on the rank that holds it (every rank's
share arrives through the all-to-all's backward) and the router's gradient summed over the ranks, in float64.
Cases: softmax and sigmoid routing with a shared expert, capacity drops, a rank whose experts no token chose
and a rank that receives no rows at all (both all-to-alls still run on it, so nothing hangs).
Whole training runs under parallel.ep: tests/train/test_expert_parallel.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.train import REPO, held_store, launch_env, store_env
from tests.parallel.expert_worker import CASES

TOLERANCE = 1e-12  # float64: the same products, summed in another order


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("experts")
    store = held_store()
    env = {**launch_env(), "WORLD_SIZE": "2", **store_env(store)}
    procs = [subprocess.Popen([sys.executable, "tests/parallel/expert_worker.py", str(out)], cwd=REPO,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)}


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_layer_equals_one_process(ranks, case):
    for rank in (0, 1):
        got = ranks[rank][case]
        for what in ("output", "input_grad", "router_grad", "expert_grads", "shared_grads"):
            assert got[what] < TOLERANCE, (rank, what, got[what])
        # rank r holds experts 2r and 2r + 1; the others are meta tensors (shape, no storage)
        assert {name.split(".")[1] for name in got["meta"]} == {str(e) for e in range(4) if e // 2 != rank}
        # an expert no token chose has no gradient, as in one process (the optimizer then skips it)
        assert got["idle"] == [name for name in got["oracle_idle"] if int(name.split(".")[1]) // 2 == rank]


def test_the_idle_cases_are_idle(ranks):
    """The cases meant to leave a rank without work do: rank 1's experts (2, 3) see no token in one, rank 0's
    in the other."""
    assert {name.split(".")[1] for name in ranks[1]["one_rank_idle"]["idle"]} == {"2", "3"}
    assert {name.split(".")[1] for name in ranks[0]["one_rank_busy"]["idle"]} == {"0", "1"}
