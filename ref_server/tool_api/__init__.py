"""The endpoints in other tools' shapes, and what they serve.

* ``completions_routes.py``: ``POST /v1/completions`` and ``GET /v1/models`` (OpenAI's shape, lm-evaluation-harness's
  ``local-completions``), scored by the reference scorer;
* ``tokenizer_routes.py``: ``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (vLLM's shape), over the model
  folder's tokenizer (``tokenizer.py``);
* ``prm_routes.py``: vLLM's ``POST /pooling`` for a process reward model, served by the local stand-in
  (``prm.py``; ``prm_tiny.py`` builds a tiny one);
* ``openai_shape.py``: what the OpenAI-shaped endpoints share (errors, JSON bodies).
"""
