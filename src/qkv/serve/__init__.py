"""`qkv serve`: an OpenAI-compatible HTTP server over a qkv run or a Hugging Face model dir.

engine: continuous batching of decoding jobs on one thread that owns the model (qkv.serve.engine).
api: the OpenAI request fields, their checks and the response shapes (qkv.serve.api).
app: the Starlette application and `serve` (uvicorn) (qkv.serve.app).
"""
