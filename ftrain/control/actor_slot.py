"""`ActorSlot`: a placed actor and where it runs (node, GPU, placement-group bundle), the unit
the actor group assigns roles to and the health monitor watches."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ActorSlot:
    """A placed actor and where it runs. `device` is (node IP, GPU id) on GPU machines and
    (node IP, bundle index) on CPU, the unit that must not hold two ranks of one group.
    `pid`: its process on that node (0: unknown)."""
    handle: object
    node_ip: str
    node_id: str
    gpu_ids: list
    bundle_index: int
    pid: int = 0

    @property
    def device(self) -> tuple:
        return (self.node_id, self.gpu_ids[0] if self.gpu_ids else f"b{self.bundle_index}")


def exited_on_its_gpus(member: ActorSlot, exited: list[ActorSlot]) -> list[int]:
    """The pids of the `exited` actors (failed ranks just replaced) that ran on `member`'s node
    and shared one of its GPUs: the processes whose memory `member` must see freed before it
    trains there (`device_probe.wait_for_exit`). Empty on CPU (no GPU ids)."""
    return [s.pid for s in exited if s.pid and s.node_id == member.node_id and set(s.gpu_ids) & set(member.gpu_ids)]
