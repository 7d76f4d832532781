"""Helpers for the Hugging Face interop tests: random-initialised transformers models from tiny configs
(never a download), saved with save_pretrained; the parity checks every family's test file runs (fp32, within
TOL = 1e-5 of transformers, both ways); and the CLI in-process."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

import qkv
import qkv.cli
from qkv.formats import hf

V = 100  # vocabulary of the random models
TOL = 1e-5
LENGTHS = [24, 17]  # right padding in row 1; long enough to reach T5's log-spaced buckets (distance >= 8)


def save_hf(model, path: Path) -> Path:
    model.eval().save_pretrained(path)
    return path


def perturbed(model):
    """`model` in eval mode with its norm gains drawn away from their init (Gemma's start at 0 for 1 + w): reading
    them, and any offset a format adds to them, is tested too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


def right_padded(batch: int, length: int, lengths: list[int], low: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, T) and a mask with row b's first lengths[b] tokens real (right padding)."""
    ids = torch.randint(low, V, (batch, length))
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Max |a - b| over the real (unpadded) positions."""
    if mask is not None:
        a, b = a[mask.bool()], b[mask.bool()]
    return float((a - b).abs().max())


def cli(*argv: str) -> tuple[int, str, str]:
    """qkv.cli.main in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = qkv.cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def check_export(run, cls, tmp_path, inputs: dict, expected: torch.Tensor, mask) -> None:
    """qkv -> HF dir -> transformers gives the same outputs again."""
    back = cls.from_pretrained(hf.save(run, tmp_path / "export")).eval()
    with torch.no_grad():
        out = back(**inputs)
    out = out.logits if hasattr(out, "logits") else out.last_hidden_state
    assert max_diff(out, expected, mask) <= TOL


def check_decoder(model, tmp_path, export: bool = True) -> None:
    """A causal LM's logits on right-padded rows, loaded by qkv and (with `export`) exported back."""
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    ids, mask = right_padded(2, 24, LENGTHS)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        got = run.model(ids, attention_mask=mask)
    assert expected.std() > 0.01  # not a degenerate all-zero comparison
    assert max_diff(got, expected, mask) <= TOL
    if export:
        check_export(run, type(model), tmp_path, {"input_ids": ids, "attention_mask": mask}, expected, mask)


def check_greedy(model, tmp_path) -> None:
    """Token for token, a batch of two left-padded prompts (positions count real tokens in both)."""
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    prompt = torch.randint(1, V, (2, 6))
    mask = torch.ones_like(prompt)
    prompt[1, :2], mask[1, :2] = 0, 0  # left padding
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = qkv.generate(run.model, prompt, max_new_tokens=20, strategy="greedy", attention_mask=mask)
    assert got.tolist() == expected.tolist()


def check_seq2seq(model, tmp_path) -> None:
    """An encoder-decoder's logits, padded sources and targets, loaded by qkv and exported back."""
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    src, src_mask = right_padded(2, 26, [26, 19])
    tgt, tgt_mask = right_padded(2, 24, LENGTHS)
    inputs = {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt,
              "decoder_attention_mask": tgt_mask}
    with torch.no_grad():
        expected = model(**inputs).logits
        got = run.model(src, tgt, src_mask, tgt_mask)
    assert expected.std() > 0.01
    assert max_diff(got, expected, tgt_mask) <= TOL
    check_export(run, type(model), tmp_path, inputs, expected, tgt_mask)
