"""Weight sync between the learner and the generators, both ends and the hub's broker, in one place.

The learner's end (imported by ``learner/``):

* :mod:`~shared.weight_sync.publisher`: every rank copies the policy into rank 0's send buffer (ZeRO-3: gathered
  one parameter at a time) and returns;
* :mod:`~shared.weight_sync.sender`: rank 0's background transfers of the buffer (relay upload, announcements);
* :mod:`~shared.weight_sync.members`: the generators holding a group with the sender and the rendezvous thread;
  it sees the sender only as :class:`~shared.weight_sync.sender_state.SenderState`, so there is no import circle;
* :mod:`~shared.weight_sync.params` (ZeRO-3 gathers) and :mod:`~shared.weight_sync.export` (a version as a
  safetensors file, the final Hugging Face folder).

The generator's end (imported by ``generator/``; its engines only add engine glue):

* :mod:`~shared.weight_sync.receiver`: between engine calls, take the newest version by the best transport;
* :mod:`~shared.weight_sync.group_receiver`: the receiving end of one group, for any engine (vLLM's workers too);
* :mod:`~shared.weight_sync.adapter`: a LoRA adapter version (``learner.lora.publish: adapter``) applied onto the
  base weights the engine keeps.

The hub's broker (imported by ``ref_server/``, whose ``relay/routes.py`` is only the HTTP side):

* :mod:`~shared.weight_sync.rendezvous`: who joins, offers, announcements, silent members;
* :mod:`~shared.weight_sync.relay_store`: the relay's versioned files, checked before they are served.

Both ends:

* :mod:`~shared.weight_sync.layout`: the flat byte layout of the policy (the safetensors data section, one dtype),
  split into bounded buckets, and the unpacker that turns received buckets back into named tensors;
* :mod:`~shared.weight_sync.groups`: the learner-to-engine process groups (gloo on CPU, NCCL on GPU) built from a
  TCPStore + PrefixStore exactly as vLLM's ``stateless_init_torch_distributed_process_group`` builds them, so a
  vLLM worker using vLLM's helper and the learner using ours meet in one group; never the default group;
* :mod:`~shared.weight_sync.ipc`: CUDA IPC handles of the send buffer as JSON (no pickle).

The JSON records the hub brokers are :mod:`shared.protocol.weight_sync_messages`, the safetensors header (one
dtype table) is :mod:`shared.protocol.safetensors_header`. vLLM's worker processes import ``group_receiver``,
``groups``, ``layout`` and ``ipc``: those import only torch, the standard library and that header module.
"""
