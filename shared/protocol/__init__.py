"""What crosses a process boundary: the typed records (rollout groups, train batches), their safetensors wire
format, the binary logprob messages and the HTTP client every service uses to talk to the hub."""
