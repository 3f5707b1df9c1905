"""The HTTP endpoints, one router per concern: scoring, hub, weights, operations (health and metrics)."""
