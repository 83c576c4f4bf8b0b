"""Where this launcher stands in a job of one or more nodes: what the launcher reads to start
its ranks of a launch (runner/launcher.py). Resolving it from the command line or SLURM, and
how the nodes agree on what to run, are runner/nodes.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500
# Node 0 serves the plan one port above the rendezvous (which its torchrun binds per launch).
PLAN_PORT_OFFSET = 1


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """This launcher's place in the job. ``nnodes == 1`` is today's single node: torchrun
    --standalone, a private rendezvous on a free port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes {self.nnodes}: must be 1 or more")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank}: must be in [0, {self.nnodes}) for --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(f"--nnodes {self.nnodes}: --master-addr is required (node 0's address, the same on"
                             " every node)")
        if not 1 <= self.master_port <= 65535 - PLAN_PORT_OFFSET:
            raise ValueError(f"--master-port {self.master_port}: must be in 1-{65535 - PLAN_PORT_OFFSET}"
                             f" (node 0 also listens on the port above it)")

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def plan_port(self) -> int:
        return self.master_port + PLAN_PORT_OFFSET

    def to_dict(self) -> dict:
        return {"nnodes": self.nnodes, "node_rank": self.node_rank, "master_addr": self.master_addr,
                "master_port": self.master_port}


SINGLE_NODE = NodeSpec()
