"""Code that two or more grpo-stack services need, in named layers; nothing in here imports ref_server,
generator, learner or deploy.

- ``grpo/``: the GRPO math (advantages, KL estimators, policy losses, masks), pure functions chosen by name.
- ``forward/``: the model forward the learner and the scorer share (chunked per-token logprobs, packing,
  shared prompt prefixes, row lengths).
- ``protocol/``: what crosses a process boundary (typed records, the safetensors wire format, the HTTP client).
- ``config/``: the one YAML config schema and its loader.
- ``weight_sync/``: learner -> generator weight transfer, both ends and the broker.
- ``errors``, ``devices``, ``registry``: small pieces every layer uses.
"""
