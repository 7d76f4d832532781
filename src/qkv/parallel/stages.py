"""The modules of a pipeline stage (qkv.parallel.pipeline): the stage's part of a DecoderLM, the staged forward
that evaluation runs, and the two rewrites of the whole model a stage needs: `release` (the other stages'
parameters become meta tensors: shape, no storage) and `retie` (a weight tied across a stage's edge stays
one parameter after FSDP2 replaced the stage's copy); `load_resident_optimizer`, a single-process optimizer
state into a model whose other ranks' parameters are meta tensors (also expert parallel's)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv import files
from qkv.models.context import self_context
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.nn.positional import Learned, Positional

# the per-parameter state tensors of qkv's optimizers (qkv.train.optim: AdamW, Adam, SGD, Muon's momentum)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


class Stage(nn.Module):
    """Blocks `layers` of a DecoderLM (the same modules, keyed by their index in the model), with the
    embedding when `first` and the final norm and LM head when `last`. `tokens` is the sequence length T
    (a later stage's input under tensor parallel holds only T / tp positions)."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool, tokens: int):
        super().__init__()
        self.first, self.last, self.tokens = first, last, tokens
        # the positional hooks act in every layer; a learned table serves the embedding only, so later
        # stages take the identity hooks instead (every parameter of a stage gets a gradient, as DDP needs)
        keeps_table = first or not isinstance(model.positional, Learned)
        self.positional = model.positional if keeps_table else Positional()
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if first:
            self.tok_emb, self.bigram_emb, self.dropout = model.tok_emb, model.bigram_emb, model.dropout
            self.embed = model.embed  # the model's embedding equation (qkv.nn.embedding), on these modules
        if last:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        """first: (B, T) ids; else (B, T, D) hidden states (T / tp of them under tensor parallel, which
        splits the stream over the sequence). -> (B, T, D), or (B, T, V) fp32 logits on the last."""
        B = x.shape[0]
        # the lm objective has no padding: positions 0..T-1 and the causal mask depend on the shape only
        ids = x if self.first else torch.zeros(B, self.tokens, dtype=torch.long, device=x.device)
        ctx = self_context(self.positional, ids, None, None, causal=True)
        if self.first:
            x = self.embed(x, ctx.positions)  # H0 (B, T, D)
        for block in self.blocks.values():
            x = block(x, ctx, None)  # no cache: (x, ctx, cache) as the decoder calls it
        if self.last:
            x = self.lm_head(self.final_norm(x)).float()  # (B, T, V): the loss reads fp32
        return x


class StagedForward(nn.Module):
    """The whole model's loss computed stage after stage on one batch (evaluation: no schedule, no
    gradient). Every rank of the pipeline calls it with the same batch; each gets the loss. `loss` is the
    objective-shaped function evaluation calls with it (qkv.train.objectives.evaluate)."""

    @staticmethod
    def loss(model: "StagedForward", batch: tuple[Tensor, Tensor], label_smoothing: float) -> Tensor:
        inputs, targets = batch
        return model(inputs, targets, label_smoothing)

    def __init__(self, pipeline):
        """`pipeline`: the qkv.parallel.pipeline.Pipeline it evaluates (its stage, ranks and group; not named as
        a type here, which would make the two modules import each other)."""
        super().__init__()
        self.pipeline, self.stage = pipeline, pipeline.stage_module

    @torch.no_grad()
    def forward(self, inputs: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        p = self.pipeline
        B, T = inputs.shape
        x = inputs
        if p.index > 0:  # (B, T, D) from the previous stage (T / tp positions under tensor parallel)
            x = torch.empty(B, p.local_tokens(T), p.d_model, device=p.device)
            dist.recv(x, src=p.ranks[p.index - 1])
        tokens, self.stage.tokens = self.stage.tokens, T
        try:
            x = self.stage(x)
        finally:
            self.stage.tokens = tokens
        if p.is_last:
            loss = cross_entropy(x, targets, label_smoothing)
        else:
            dist.send(x.float().contiguous(), dst=p.ranks[p.index + 1])
            loss = torch.zeros((), device=p.device)
        dist.broadcast(loss, src=p.ranks[-1], group=p.group)
        return loss


def retie(model: nn.Module, stage: nn.Module, entries: dict[tuple[int, str], nn.Parameter]) -> None:
    """After `stage`'s parameters were replaced (FSDP2's sharded ones), point every other reference in
    `model` to the replacement: a weight tied across the stage's edge (W_E, read by the last stage's head
    and held by the embedding module outside it) stays one parameter. `entries`: (module, name) -> the
    parameter before (held, so that no id is reused while this runs)."""
    replaced = {id(entries[(id(m), n)]): p for m in stage.modules() for n, p in m._parameters.items()
                if p is not None and (id(m), n) in entries and entries[(id(m), n)] is not p}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced and param is entries.get((id(module), name)):
                module._parameters[name] = replaced[id(param)]


def release(model: nn.Module, keep: set[int]) -> None:
    """Replace each parameter of `model` whose id is not in `keep` by a meta tensor of its shape (one per
    parameter, so a tied pair stays tied): its storage is freed; names and order are unchanged."""
    meta: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) in keep:
                continue
            if id(param) not in meta:
                meta[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                               requires_grad=param.requires_grad)  # a DTensor's global shape
            module._parameters[name] = meta[id(param)]


def load_resident_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], groups: list[dict]) -> None:
    """A single-process optimizer state (qkv.files.optimizer_tensors) into a model whose other ranks' parameters
    are meta tensors: each resident parameter's state cut to its shard (every rank read the same file), the
    others' dropped."""
    order = [p for group in optimizer.param_groups for p in group["params"]]
    mine = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            param = order[int(key.split(".")[1])]
            if not param.is_meta:
                mine[key] = files.shard_like(value, param) if value.dim() else value
    files.load_optimizer(optimizer, mine, groups)
