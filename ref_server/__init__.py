"""The reference server: per-token reference logprobs over HTTP, the rollout hub and the weight relay."""
