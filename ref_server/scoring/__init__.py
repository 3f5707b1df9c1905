"""Reference scoring: the micro-batching scorer over the reference model (``scorer.py``, top-k logprobs from the
chunked LM head in ``top_logprobs.py``), its loading (``loading.py``), the model's context rule (``context.py``) and
its endpoint ``POST /v1/logprobs`` (``logprobs_routes.py``). Who scores (the hub's own scorer or joined ones) is
decided by the scorer pool (:mod:`ref_server.scorer_pool`); the OpenAI- and vLLM-shaped endpoints that also score
are in :mod:`ref_server.tool_api`."""
