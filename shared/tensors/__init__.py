"""The ground floor of the tensor code: masks from lengths, masked reductions (:mod:`shared.tensors.masks`) and the
moves between host and device that never wait for the device (:mod:`shared.tensors.transfers`).

These modules import torch and nothing else of grpo-stack, so that the math (:mod:`shared.grpo`), the forward
(:mod:`shared.forward`), the wire (:mod:`shared.protocol`) and the services all build on them without importing
one another.
"""
