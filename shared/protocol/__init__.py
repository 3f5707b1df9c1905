"""What crosses a process boundary: the typed records (rollout groups, train batches), their safetensors wire format
and the one safetensors header module (dtype table, header writing and checks) it shares with the weight sync, the
binary logprob messages, the weight-sync rendezvous messages and the HTTP client every service uses to talk to the
hub."""
