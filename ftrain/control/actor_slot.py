"""`ActorSlot`: a placed actor and where it runs (node, GPU, placement-group bundle), the unit
the actor group assigns roles to and the health monitor watches."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ActorSlot:
    """A placed actor and where it runs. `device` is (node IP, GPU id) on GPU machines and
    (node IP, bundle index) on CPU, the unit that must not hold two ranks of one group."""
    handle: object
    node_ip: str
    node_id: str
    gpu_ids: list
    bundle_index: int

    @property
    def device(self) -> tuple:
        return (self.node_id, self.gpu_ids[0] if self.gpu_ids else f"b{self.bundle_index}")
