"""LoRA on a tensor-parallel rank: the core keeps the adapters (``LoraManager``: registry, host cache, slot
book), the workers keep the device slots.

The core's manager writes a slot through ``BroadcastDevice``: the adapter's tensors go to every worker in one
``LoraSlot`` broadcast (``pack``: safetensors bytes), ahead of the step that first uses the slot (the
broadcast channel keeps order); each worker copies its own shard into its slot (``lbd.engine.lora.slots``:
``ProjectionLora.rows``/``cols``). The step's per-sequence slots travel in ``Step.lora_slots`` and each
worker builds the same ``LoraStep`` from them (``set_step``). Pipeline parallelism is not covered (the
flags refuse it: ``lbd.engine.config.lora``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lbd.engine.lora.peft import AdapterWeights
from lbd.engine.lora.slots import LoraDevice
from lbd.wire.executor_messages import LoraSlot


def pack(weights: AdapterWeights) -> bytes:
    """Every (layer, projection)'s A and B as one safetensors blob (names ``<layer>.<projection>.a|b``)."""
    from safetensors.torch import save

    flat: dict[str, torch.Tensor] = {}
    for (layer, module), (a, b) in weights.tensors.items():
        flat[f"{layer}.{module}.a"], flat[f"{layer}.{module}.b"] = a.contiguous(), b.contiguous()
    return save(flat)


def unpack(data: bytes) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``pack``'s inverse: (layer, projection) -> (A [r, in], B [out, r])."""
    from safetensors.torch import load

    flat = load(data)
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for name, a in flat.items():
        layer, module, part = name.split(".")
        if part == "a":
            out[(int(layer), module)] = (a, flat[f"{layer}.{module}.b"])
    return out


class BroadcastDevice:
    """The core side of a TP rank's slots: ``write`` sends the adapter to every worker (``send`` is the
    executor's broadcast). It has no step to set: the executor sends the slots with each step."""

    def __init__(self, send: Callable[[LoraSlot], None]) -> None:
        self.send = send

    def write(self, slot: int, weights: AdapterWeights) -> None:
        self.send(LoraSlot(slot, pack(weights)))


def write_slot(device: LoraDevice, msg: LoraSlot) -> None:
    """A worker's side of ``BroadcastDevice.write``: its shard of the adapter into slot ``msg.slot``."""
    device.write_tensors(msg.slot, unpack(msg.tensors))


def set_step(device: LoraDevice, lora_slots: list[int], query_lens: list[int], torch_device: Any) -> None:
    """A worker's step: each sequence's slot (``Step.lora_slots``; empty: every sequence on the base model)
    and new tokens, in batch order."""
    slots = lora_slots or [-1] * len(query_lens)
    device.set_step(list(zip(slots, query_lens, strict=True)), torch_device)
