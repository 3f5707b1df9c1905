"""The model forward both the learner and the reference scorer run: per-token logprobs without ``[B, T, V]``,
packed rows, shared prompt prefixes, and the row lengths that masks derive from."""
