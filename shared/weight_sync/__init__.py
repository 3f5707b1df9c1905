"""Weight sync between the learner and the generators: what both sides share.

* :mod:`shared.weight_sync.layout`: the flat byte layout of the policy (the safetensors data section, one dtype),
  split into bounded buckets, and the unpacker that turns received buckets back into named tensors;
* :mod:`shared.weight_sync.groups`: the learner-to-engine process groups (gloo on CPU, NCCL on GPU) built from a
  TCPStore + PrefixStore exactly as vLLM's ``stateless_init_torch_distributed_process_group`` builds them, so a
  vLLM worker using vLLM's helper and the learner using ours meet in one group; never the default group;
* :mod:`shared.weight_sync.messages`: the typed records the hub brokers (sender, join, offer);
* :mod:`shared.weight_sync.ipc`: CUDA IPC handles of the send buffer as JSON (no pickle).

Only torch and the standard library are imported here: vLLM's worker processes import this package.
"""
