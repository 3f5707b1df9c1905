"""Reference scoring: the micro-batching scorer over the reference model (``scorer.py``, top-k logprobs from the
chunked LM head in ``top_logprobs.py``), the model folder's tokenizer (``tokenizer.py``), and their endpoints:
``POST /v1/logprobs`` (``logprobs_routes.py``), ``POST /v1/completions`` and ``GET /v1/models``
(``completions_routes.py``), ``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (``tokenizer_routes.py``); the
OpenAI-shaped endpoints share ``openai_shape.py``."""
