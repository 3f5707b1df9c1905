"""A user's agent as the rollout: the generator serves OpenAI-compatible routes per episode (server.py, routes.py),
records every call token in, token out (episodes.py, chat.py), samples with its engine (sampler.py), and runs the
agent G times per prompt (runner.py). docs/agents.md says how to use it."""
