"""The sft objective (`qkv train --task sft --init RUN_OR_GGUF --data FILE.jsonl`; docs/finetune.md): supervised
fine-tuning on conversations, the loss on the tokens the model is taught to produce (qkv.data.sft: note 000
§13.1's cross-entropy with a mask), examples packed with document masks.

Rows, one JSON object a line (the forms trl's SFTTrainer takes):
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
        rendered with the model's chat template (qkv.formats.chat: the one its file carries, else qkv's plain
        default); the loss is on every assistant turn: the text the template adds for it, its end-of-turn included
    {"prompt": "...", "completion": "..."}
        plain text, no template: prompt then completion then end-of-text; the loss on the completion and the end
    {"prompt": [messages], "completion": [messages]}
        a conversation whose completion turns alone are trained

A turn's tokens are found by rendering the conversation up to it: render(m_<i, add_generation_prompt) is what
precedes assistant turn i and render(m_<=i) what ends it; the pieces between are tokenized one by one, the way
generation sees them (the prompt tokenized, the reply produced token by token). Turns after the last trained
one teach nothing and are left out. A row that breaks a rule (an unknown role, an empty assistant turn, no turn
to train, text that is not UTF-8, longer than train.seq_len) is an error naming its file and line.
"""
from __future__ import annotations

import numpy as np
from torch import Tensor, nn

from qkv.data.corpus import read_json_rows
from qkv.data.dataset import Prepared, default_cache_dir
from qkv.data.sft import Examples, PackedBatches
from qkv.data.tokenizer import Tokenizer, needs_tokenizer
from qkv.errors import QkvError
from qkv.formats.base import Chat
from qkv.formats.chat import ChatTemplate, template_for
from qkv.nn.linear_cross_entropy import head_cross_entropy, target_rows
from qkv.parallel.layout import unwrapped

ROLES = ("system", "user", "assistant")


def check_messages(messages, origin: str, what: str = "messages") -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise QkvError(f"{origin}: {what} must be a non-empty list of {{\"role\", \"content\"}} objects")
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise QkvError(f"{origin}: {what}[{number}] must be an object with a string \"content\"")
        if message.get("role") not in ROLES:
            raise QkvError(f"{origin}: {what}[{number}] has role {message.get('role')!r}; choose from "
                           f"{', '.join(ROLES)}")
        if message["role"] == "assistant" and not message["content"].strip():
            raise QkvError(f"{origin}: {what}[{number}] is an empty assistant turn")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_conversation(template: ChatTemplate, messages: list[dict], origin: str,
                        trained_from: int = 0) -> tuple[list[int], list[bool]]:
    """(ids, trained) of a conversation; the assistant turns at index >= trained_from are trained."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= trained_from]
    if not turns:
        raise QkvError(f"{origin}: no assistant turn to train on")
    ids, trained, done = list(template.prefix), [False] * len(template.prefix), ""
    for i in turns:
        try:
            before = template.render(messages[:i], add_generation_prompt=True)
            through = template.render(messages[:i + 1], add_generation_prompt=False)
        except ValueError as error:
            raise QkvError(f"{origin}: {error}") from None
        if not (before.startswith(done) and through.startswith(before)):
            raise QkvError(f"{origin}: the chat template does not render this conversation turn by turn (the text "
                           f"before assistant turn {i + 1} is not a prefix of the text through it)")
        for text, train in ((before[len(done):], False), (through[len(before):], True)):
            piece = template.encode(text) if text else []
            ids += piece
            trained += [train] * len(piece)
        done = through
    return ids, trained


def encode_plain(tokenizer: Tokenizer, prompt: str, completion: str, origin: str) -> tuple[list[int], list[bool]]:
    if not completion.strip():
        raise QkvError(f"{origin}: empty completion")
    first, second = tokenizer.encode(prompt), tokenizer.encode(completion) + [tokenizer.eos_id]
    return first + second, [False] * len(first) + [True] * len(second)


def encode_row(record: dict, origin: str, template: ChatTemplate, tokenizer: Tokenizer):
    if "messages" in record:
        return encode_conversation(template, check_messages(record["messages"], origin), origin)
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return encode_plain(tokenizer, prompt, completion, origin)
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt, completion = check_messages(prompt, origin, "prompt"), check_messages(completion, origin, "completion")
        return encode_conversation(template, prompt + completion, origin, trained_from=len(prompt))
    raise QkvError(f"{origin}: expected {{\"messages\": [...]}} or {{\"prompt\", \"completion\"}} (both text, or "
                   "both lists of messages)")


def read_examples(paths, tokenizer: Tokenizer, chat: Chat) -> Examples:
    template = template_for(chat, tokenizer)
    examples = Examples()
    for path in paths:
        for origin, record in read_json_rows(path):
            ids, trained = encode_row(record, origin, template, tokenizer)
            examples.add(ids, trained, origin)
    if not len(examples):
        raise QkvError(f"{', '.join(paths)}: no rows")
    return examples


def split(examples: Examples, val_fraction: float, seed: int) -> tuple[Examples, Examples]:
    """A held-out share of the rows (at least one; all rows train when there is only one), chosen by a seeded
    permutation so that sorted files do not hold out one kind of row."""
    n = len(examples)
    held = max(1, round(n * val_fraction)) if n > 1 else 0
    order = np.random.Generator(np.random.PCG64(seed)).permutation(n)
    parts = (Examples(), Examples())
    for rank, i in enumerate(order):
        parts[rank < held].add(examples.ids[i].tolist(), examples.trained[i].tolist(), examples.origins[i])
    train, val = parts
    return train, (val if held else train)


def prepare(cfg, tokenizer: Tokenizer | None, chat: Chat | None = None) -> Prepared:
    if not cfg.train.init:
        raise QkvError("train.objective='sft' fine-tunes a model: give --init RUN_OR_GGUF (a qkv run, a Hugging "
                       "Face dir or a GGUF file)")
    if not cfg.data.paths:
        raise QkvError("train.objective='sft' needs --data FILE.jsonl (rows of {\"messages\": [...]} or "
                       "{\"prompt\", \"completion\"})")
    tokenizer = needs_tokenizer(tokenizer, "sft")
    train, val = split(read_examples(cfg.data.paths, tokenizer, chat or Chat()), cfg.data.val_fraction, cfg.train.seed)
    for part in (train, val):
        part.check_fits(cfg.train.seq_len)
    return Prepared(tokenizer=tokenizer, train=train, val=val, val_chars=0, cache_dir=default_cache_dir())


def batches(examples, tokenizer: Tokenizer | None, cfg, *, batch_size: int, seed: int) -> PackedBatches:
    if not isinstance(examples, Examples):
        raise QkvError("train.objective='sft' trains on examples read from --data FILE.jsonl, not a token stream")
    return PackedBatches(examples, cfg.train.seq_len, batch_size, seed, pad_id=tokenizer.eos_id)


def loss(model: nn.Module, batch: tuple[Tensor, ...], label_smoothing: float) -> Tensor:
    """The cross-entropy of the micro-batch's trained tokens, summed and scaled so that the step's loss is
    L = -sum m log p / sum m over the whole batch (qkv.data.sft: PackedBatches' scale)."""
    inputs, targets, documents, scale = batch  # (b, T) x 3, (b,)
    hidden = model(inputs, head=False, documents=documents)  # (b, T, D)
    hidden, targets = target_rows(hidden, targets)  # (n, D), (n,): the head on the trained positions only
    if len(targets) == 0:  # rows without a trained token (possible only in a tiny batch): nothing to learn
        return hidden.sum() * 0.0
    mean = head_cross_entropy(unwrapped(model).lm_head, hidden, targets, label_smoothing)
    return mean * (len(targets) * scale[0] / inputs.shape[0])
