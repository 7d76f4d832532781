"""qkv.ref.cases: the layer cases themselves. Every layer case has a torch oracle and is checked by exactly
one module's test file (tests/ref/test_<module>.py); a case's inputs are a function of the generator alone and
its forward does not change them, so finite differences and autograd see the same point."""
import importlib

import numpy as np

from qkv.ref import gradcheck
from tests.ref.torch_oracles import ORACLES

MODULE_FILES = ("functional", "attention", "block", "ffn", "kernels", "flash", "linear_attention", "norms",
                "moe", "positional", "relative")


def layer_cases():
    """Whole-model cases ("model_*": a decoder's loss along random directions) are proved by finite
    differences (test_gradcheck.py); whole models meet torch in test_model.py and test_encoder.py."""
    return [n for n in gradcheck.CASES.names() if not n.startswith(("test-", "model_"))]


def test_every_layer_case_has_a_torch_oracle():
    assert sorted(ORACLES) == layer_cases()


def test_every_layer_case_is_checked_by_exactly_one_module_file():
    checked = [case for name in MODULE_FILES for case in importlib.import_module(f"tests.ref.test_{name}").CASES]
    assert sorted(checked) == layer_cases()  # sorted lists: a case selected twice would show up twice


def test_inputs_depend_on_the_seed_only_and_the_forward_leaves_them_unchanged():
    for name in gradcheck.CASES.names():
        spec = gradcheck.CASES.get(name)
        first, again = spec.inputs(np.random.default_rng(5)), spec.inputs(np.random.default_rng(5))
        saved = {k: np.copy(v) for k, v in first.items()}
        spec.forward(first)
        for key, value in saved.items():
            np.testing.assert_array_equal(first[key], value, err_msg=f"{name}: {key} changed by the forward")
            np.testing.assert_array_equal(again[key], value, err_msg=f"{name}: {key} differs between draws")
