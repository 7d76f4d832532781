"""A live `qkv serve` on 127.0.0.1 (any free port) in a thread of the test process, and tiny run dirs."""
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import qkv
from qkv import files
from qkv.config import RunConfig
from qkv.data.tokenizer import Tokenizer
from qkv.serve.server import listen, prepare, server_for

TEXT = "the cat sat on the mat.\n\nthe dog ran to the cat.\nwhere is the cat? on the mat, said the dog.\n"


def tokenizer() -> Tokenizer:
    return Tokenizer.train([TEXT * 20], 300)


def write_run(path: Path, tok: Tokenizer | None = None, **model) -> Path:
    """config.json, tokenizer.json and model.safetensors of a small random model (init_std 0.3: peaked logits)."""
    tok = tok or tokenizer()
    torch.manual_seed(0)
    fields = dict(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64,
                  positional="rope", init_std=0.3)
    cfg = qkv.ModelConfig(**{**fields, **model})
    path.mkdir(parents=True)
    RunConfig(model=cfg).save(path / "config.json")
    tok.save(path / "tokenizer.json")
    model = qkv.build_model(cfg)
    if getattr(model, "bigram_emb", None) is not None:  # zero at init: give the table rows to read
        torch.nn.init.normal_(model.bigram_emb.weight, std=cfg.init_std)
    save_file(files.model_tensors(model), str(path / files.MODEL_FILE))
    return path


class Live:
    """`with Live(run_dir, max_batch=...) as live:` a started server; live.url, live.served (its engine)."""

    def __init__(self, path: Path, **options):
        self.served = prepare(str(path), log=lambda message: None, **options)
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = server_for(self.served)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Live":
        self.served.engine.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.served.engine.stop()
        self.sock.close()

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)
