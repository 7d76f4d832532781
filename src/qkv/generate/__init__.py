"""Text generation: logit processors and strategies (sampling), KV-cached decoding (decode).

`qkv.generate(model, input_ids, ...)` is `decode.generate` (decoder-only and encoder-decoder models,
qkv.generate.families); `beam_search` returns the n-best list of one prompt.
"""
import sys
import types

from qkv.generate.decode import (CachedDecoder, Hypothesis, PromptTruncatedWarning, beam_search, generate,
                                 pad_left)
from qkv.generate.families import PROMPTS, Seq2SeqDecoder
from qkv.generate.sampling import PROCESSORS, STRATEGIES, SamplingParams, SamplingState, Strategy

__all__ = ["CachedDecoder", "PROMPTS", "Hypothesis", "PROCESSORS", "PromptTruncatedWarning", "STRATEGIES",
           "SamplingParams", "SamplingState", "Seq2SeqDecoder", "Strategy", "beam_search", "generate", "pad_left"]


class _CallablePackage(types.ModuleType):
    """Importing this package makes Python set the attribute `qkv.generate` to the package itself,
    hiding the function of the same name that qkv/__init__.py exposes; calling the package calls
    the function, so `qkv.generate(model, ids)` works either way."""

    __call__ = staticmethod(generate)


sys.modules[__name__].__class__ = _CallablePackage
