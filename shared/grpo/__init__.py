"""The GRPO math as pure functions over tensors: advantages, KL estimators, policy losses and their aggregations,
masks. Each variant is registered by name (``shared.registry``) so a config string chooses it."""
