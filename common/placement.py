"""Where a model's KV lives, as the blend backend decided it (blend/backend.py: `Backend.placement`).

The store is handed a Placement instead of asking the device itself, so the device is decided in one place:
a lower package reads these fields and never branches on a device type.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    device: torch.device      # the model's device: a KV layer read for the model lands here
    on_host: bool = True      # `device` is the host's memory (a tensor tier there holds plain host tensors)
    pin: bool = False         # host buffers bound for `device` are page-locked (copies to a GPU overlap compute)
    device_free_bytes: int = 0  # the device's free memory once the model is loaded (0 on the host): gpu tier "auto"


HOST = Placement(torch.device("cpu"))
