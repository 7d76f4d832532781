"""The dpo objective (`qkv train --task dpo --init RUN_OR_GGUF --data PAIRS.jsonl`; docs/finetune.md): Direct
Preference Optimization (Rafailov et al. 2023) on rows {"prompt", "chosen", "rejected"} (text, or lists of messages
as qkv.train.sft reads them).

With log pi(y|x) the sum of the log-probabilities of the completion's tokens (qkv eval's sum, the prompt not
counted), the implicit reward and the loss of a pair (y_w chosen, y_l rejected) are

    r(x, y) = beta (log pi_theta(y|x) - log pi_ref(y|x))
    L = -log sigma(r(x, y_w) - r(x, y_l))
    dL/dtheta = -beta sigma(r(x, y_l) - r(x, y_w)) (grad log pi_theta(y_w|x) - grad log pi_theta(y_l|x))

so a pair the model already ranks far apart weighs little. The reference pi_ref is the --init model, frozen: its
log-probabilities of every pair are computed once before the first step (trl's precompute_ref_log_probs) and kept
in the run dir (dpo_reference.safetensors), so training holds no second copy of the model and runs no second
forward; with LoRA the model at that moment is the base with adapters at B = 0, i.e. the adapters off. Logged per
step: the loss, the mean rewards of chosen and rejected, their margin and the reward accuracy (r_w > r_l).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.data.corpus import read_json_rows
from qkv.data.dataset import Prepared, default_cache_dir
from qkv.data.sft import IGNORE, Examples
from qkv.data.tokenizer import Tokenizer, needs_tokenizer
from qkv.errors import QkvError
from qkv.formats.base import Chat
from qkv.formats.chat import template_for
from qkv.nn.linear_cross_entropy import target_rows
from qkv.parallel.layout import unwrapped
from qkv.train import sft

REFERENCE_FILE = "dpo_reference.safetensors"
STATS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


@dataclass
class Pairs:
    """Pair i: chosen.ids[i] and rejected.ids[i] (the same prompt); reference (N, 2) the init model's
    log pi_ref of each, None until computed."""

    chosen: Examples
    rejected: Examples
    reference: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def tokens(self) -> int:
        return self.chosen.tokens + self.rejected.tokens

    def take(self, order) -> "Pairs":
        out = Pairs(Examples(), Examples(), None if self.reference is None else self.reference[order])
        for i in order:
            for part, mine in ((out.chosen, self.chosen), (out.rejected, self.rejected)):
                part.add(mine.ids[i].tolist(), mine.trained[i].tolist(), mine.origins[i])
        return out


def read_pairs(paths, tokenizer: Tokenizer, chat: Chat) -> Pairs:
    template = template_for(chat, tokenizer)
    pairs = Pairs(Examples(), Examples())
    for path in paths:
        for origin, record in read_json_rows(path):
            if not all(key in record for key in ("prompt", "chosen", "rejected")):
                raise QkvError(f"{origin}: expected {{\"prompt\", \"chosen\", \"rejected\"}} (text, or lists of "
                               "messages)")
            if record["chosen"] == record["rejected"]:
                raise QkvError(f"{origin}: chosen and rejected are the same; the pair prefers nothing")
            for part, key in ((pairs.chosen, "chosen"), (pairs.rejected, "rejected")):
                ids, trained = sft.encode_row({"prompt": record["prompt"], "completion": record[key]}, origin,
                                              template, tokenizer)
                part.add(ids, trained, origin)
    if not len(pairs):
        raise QkvError(f"{', '.join(paths)}: no rows")
    return pairs


def prepare(cfg, tokenizer: Tokenizer | None, chat: Chat | None = None) -> Prepared:
    if not cfg.train.init:
        raise QkvError("train.objective='dpo' tunes a model against itself: give --init RUN_OR_GGUF")
    if not cfg.data.paths:
        raise QkvError("train.objective='dpo' needs --data PAIRS.jsonl (rows of {\"prompt\", \"chosen\", "
                       "\"rejected\"})")
    if cfg.train.label_smoothing:
        raise QkvError(f"train.label_smoothing={cfg.train.label_smoothing}: DPO's loss is the pair's logistic loss "
                       "(set it to 0)")
    tokenizer = needs_tokenizer(tokenizer, "dpo")
    pairs = read_pairs(cfg.data.paths, tokenizer, chat or Chat())
    for part in (pairs.chosen, pairs.rejected):
        part.check_fits(cfg.train.seq_len)
    n = len(pairs)
    held = max(1, round(n * cfg.data.val_fraction)) if n > 1 else 0
    order = np.random.Generator(np.random.PCG64(cfg.train.seed)).permutation(n)
    train, val = pairs.take(order[held:]), pairs.take(order[:held] if held else order)
    return Prepared(tokenizer=tokenizer, train=train, val=val, val_chars=0, cache_dir=default_cache_dir())


def rows(pairs: Pairs, index, seq_len: int, pad_id: int, beta: float) -> tuple[np.ndarray, ...]:
    """inputs, targets, documents (B, 2, T) int64 (chosen, rejected; right padding is a document of its own),
    reference (B, 2) and beta (B,) float32."""
    B = len(index)
    inputs = np.full((B, 2, seq_len), pad_id, dtype=np.int64)
    targets = np.full((B, 2, seq_len), IGNORE, dtype=np.int64)
    documents = np.ones((B, 2, seq_len), dtype=np.int64)
    for row, i in enumerate(index):
        for side, part in enumerate((pairs.chosen, pairs.rejected)):
            n = len(part.ids[i])
            inputs[row, side, :n], targets[row, side, :n], documents[row, side, :n] = part.ids[i], part.targets(i), 0
    reference = np.zeros((B, 2)) if pairs.reference is None else pairs.reference[index]
    reference = reference.astype(np.float32)
    return inputs, targets, documents, reference, np.full(B, beta, dtype=np.float32)


class PairBatches:
    """batch_size pairs a batch, each epoch in the order of a permutation from Generator(PCG64(seed + epoch))."""

    def __init__(self, pairs: Pairs, seq_len: int, batch_size: int, seed: int, pad_id: int, beta: float):
        if not len(pairs):
            raise QkvError("no pairs to train on")
        self.pairs, self.seq_len, self.batch_size, self.seed = pairs, seq_len, batch_size, seed
        self.pad_id, self.beta = pad_id, beta
        self.epoch, self.cursor, self.drawn = 0, 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.Generator(np.random.PCG64(self.seed + self.epoch)).permutation(len(self.pairs))

    def next(self) -> tuple[np.ndarray, ...]:
        index = []
        while len(index) < self.batch_size:
            if self.cursor == len(self.pairs):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation()
            index.append(int(self._order[self.cursor]))
            self.cursor += 1
        self.drawn += 1
        return rows(self.pairs, index, self.seq_len, self.pad_id, self.beta)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "batches": self.drawn, "pairs": len(self.pairs),
                "batch_size": self.batch_size, "seq_len": self.seq_len}

    def load_state(self, state: dict) -> None:
        mine = {"pairs": len(self.pairs), "batch_size": self.batch_size, "seq_len": self.seq_len}
        if {key: state.get(key) for key in mine} != mine:
            raise QkvError(f"data state is for {({key: state.get(key) for key in mine})}; this run has {mine}")
        self.epoch, self.cursor, self.drawn = int(state["epoch"]), int(state["cursor"]), int(state["batches"])
        self._order = self._permutation()


def batches(pairs, tokenizer: Tokenizer | None, cfg, *, batch_size: int, seed: int) -> PairBatches:
    if not isinstance(pairs, Pairs):
        raise QkvError("train.objective='dpo' trains on pairs read from --data PAIRS.jsonl, not a token stream")
    return PairBatches(pairs, cfg.train.seq_len, batch_size, seed, pad_id=tokenizer.eos_id, beta=cfg.train.dpo_beta)


def sequence_logps(model: nn.Module, inputs: Tensor, targets: Tensor, documents: Tensor) -> Tensor:
    """(R, T) rows -> (R,) sum over each row's trained tokens of log p(token | before): the head only on them."""
    hidden = model(inputs, head=False, documents=documents)  # (R, T, D)
    rows_of = torch.arange(inputs.shape[0], device=inputs.device)[:, None].expand_as(targets)  # (R, T)
    picked, wanted = target_rows(hidden, targets)  # (n, D), (n,)
    logits = unwrapped(model).lm_head(picked).float()  # (n, V)
    token_logps = logits.log_softmax(-1).gather(-1, wanted[:, None])[:, 0]  # (n,)
    return torch.zeros(inputs.shape[0], device=inputs.device).index_add(0, rows_of[targets != IGNORE], token_logps)


def pair_loss(logps: Tensor, reference: Tensor, beta: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """logps, reference (B, 2) [chosen, rejected], beta (B,) -> the mean DPO loss and the step's statistics."""
    rewards = beta[:, None] * (logps - reference)  # (B, 2)
    margin = rewards[:, 0] - rewards[:, 1]  # (B,)
    loss = -F.logsigmoid(margin).mean()
    stats = {"reward_chosen": rewards[:, 0].mean(), "reward_rejected": rewards[:, 1].mean(),
             "reward_margin": margin.mean(), "reward_accuracy": (margin > 0).float().mean()}
    return loss, {name: value.detach() for name, value in stats.items()}


class Recorder:
    """The statistics of the micro-batches since the last take(): the Trainer logs their means each step."""

    def __init__(self):
        self.values: dict[str, list[Tensor]] = {}

    def add(self, stats: dict[str, Tensor]) -> None:
        for name, value in stats.items():
            self.values.setdefault(name, []).append(value)

    def take(self) -> dict[str, Tensor]:
        out = {name: torch.stack(values).mean() for name, values in self.values.items()}
        self.values = {}
        return out


RECORDER = Recorder()


def loss(model: nn.Module, batch: tuple[Tensor, ...], label_smoothing: float) -> Tensor:
    inputs, targets, documents, reference, beta = batch  # (B, 2, T) x 3, (B, 2), (B,)
    B = inputs.shape[0]
    logps = sequence_logps(model, inputs.flatten(0, 1), targets.flatten(0, 1), documents.flatten(0, 1)).view(B, 2)
    value, stats = pair_loss(logps, reference.float(), beta.float())
    RECORDER.add(stats)
    return value


@torch.no_grad()
def reference_logps(model: nn.Module, pairs: Pairs, seq_len: int, pad_id: int, device, batch_size: int = 8,
                    autocast=None) -> np.ndarray:
    """(N, 2) log pi_ref of every pair's chosen and rejected completion under `model` (eval mode)."""
    was_training = model.training
    model.eval()
    out = np.zeros((len(pairs), 2), dtype=np.float64)
    for start in range(0, len(pairs), batch_size):
        index = list(range(start, min(start + batch_size, len(pairs))))
        arrays = rows(pairs, index, seq_len, pad_id, 0.0)
        inputs, targets, documents = (torch.from_numpy(a).to(device) for a in arrays[:3])
        with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
            logps = sequence_logps(model, inputs.flatten(0, 1), targets.flatten(0, 1), documents.flatten(0, 1))
        out[start:start + len(index)] = logps.view(-1, 2).double().cpu().numpy()
    model.train(was_training)
    return out


def setup(trainer, resume: bool) -> None:
    """Before the first step: the reference log-probabilities of every pair, by the model as it starts (the
    init; with LoRA the adapters at B = 0) and saved in the run dir, or read back from it on a resume."""
    from safetensors.torch import load_file, save_file

    data, file = trainer.data, trainer.run_dir / REFERENCE_FILE
    if resume:
        if not file.is_file():
            raise QkvError(f"{file}: missing; the reference log-probabilities of a DPO run cannot be recomputed from "
                           "the trained model: restore it or start again")
        saved = load_file(str(file))
        for name, part in (("train", data.train), ("val", data.val)):
            if name not in saved or tuple(saved[name].shape) != (len(part), 2):
                raise QkvError(f"{file}: has no ({len(part)}, 2) tensor {name!r}; it is not this run's")
            part.reference = saved[name].double().numpy()
        return
    for part in (data.train, data.val):
        part.reference = reference_logps(trainer.model, part, trainer.tc.seq_len, data.tokenizer.eos_id,
                                         trainer.device, autocast=trainer.autocast)
    if trainer.layout.is_main:
        save_file({"train": torch.from_numpy(data.train.reference), "val": torch.from_numpy(data.val.reference)},
                  str(file))


@torch.no_grad()
def report(trainer) -> dict:
    """Held-out pairs: the reward accuracy and margin of the trained model, and how often the init and the trained
    model give the chosen completion the higher log-probability."""
    val = trainer.data.val
    policy = reference_logps(trainer.model, val, trainer.tc.seq_len, trainer.data.tokenizer.eos_id, trainer.device,
                             autocast=trainer.autocast)
    margin = trainer.tc.dpo_beta * ((policy[:, 0] - val.reference[:, 0]) - (policy[:, 1] - val.reference[:, 1]))
    return {"val_reward_accuracy": float(np.mean(margin > 0)), "val_reward_margin": float(np.mean(margin)),
            "val_preference_accuracy_init": float(np.mean(val.reference[:, 0] > val.reference[:, 1])),
            "val_preference_accuracy": float(np.mean(policy[:, 0] > policy[:, 1]))}
