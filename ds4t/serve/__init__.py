"""``ds4t serve``: an OpenAI-compatible HTTP server over N resident sessions (docs/design.md).

* :mod:`~ds4t.serve.planner`     memory plan: weights + N x state at max ctx + workspace vs the device
* :mod:`~ds4t.serve.pool`        the N pre-allocated sessions and prefix routing
* :mod:`~ds4t.serve.worker`      the decode worker: coalesced, chunked-prefill, mixed batches
* :mod:`~ds4t.serve.persistence` idle states on disk (atomic, checksummed safetensors files)
* :mod:`~ds4t.serve.http`        the aiohttp app: /v1/completions, /v1/chat/completions, /v1/models,
                                 /health, /metrics
* :mod:`~ds4t.serve.cli`         ``ds4t serve`` arguments

Text comes from :mod:`ds4t.text` (tokenizer.json or bytes; chat templates). Only the public model API is used (Session, DecodeItem, eval_batch, state_dict/load_state_dict,
pool.reserve/bytes_per_slot), so every model family serves the same way.
"""
