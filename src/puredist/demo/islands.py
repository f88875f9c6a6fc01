"""``python -m puredist demo --islands N``: islands of workers joined by slow links.

The shape of cross-datacenter training: inside an island the workers share a fast
fabric; between islands one slow link. Each island is a group of worker network
namespaces, each joined by a veth pair to the island's bridge (unshaped) in a gateway
namespace; each gateway is joined to one router namespace by a veth pair, the
inter-island link, whose two directions are shaped by ``tbf`` to the rate (the
gateway's egress towards the router, the router's towards the gateway). Traffic
between islands crosses two such links (out of one island, into the other), traffic
inside an island none.

Addresses exist only inside the run's namespaces (:data:`ISLAND_SUBNET`,
:data:`UPLINK_SUBNET`), named with a prefix unique to the run
(``puredist-<pid>-<random>``): ``-router``, ``-i<island>`` (its gateway) and
``-i<island>w<worker>``. :class:`Islands` builds them and removes them on every way
out of its ``with`` block (a normal end, an exception, Ctrl-C, SIGTERM or SIGHUP, a
worker killed), killing first any process still running in one of them (only this
run's launchers and workers can be: the namespaces are its own). A SIGKILL of the
launcher itself leaves them: ``ip netns list`` shows them by their prefix.

Each island is started as a node of a multi-node job is: one ``torchrun --nnodes N
--node-rank i --rdzv-backend c10d`` (:func:`launcher_command`) in the island's gateway
namespace, its rendezvous endpoint the first island's gateway on the inter-island
network (``--rdzv-conf is_host=1`` there), every node's ``--local-addr`` its own
gateway's address there (host names do not resolve inside the namespaces).

This module must not train: it places the islands and measures their links.
"""

from __future__ import annotations

import sys
from typing import Sequence

from puredist.demo.links import INTERFACE, LinkError, Namespaces, Rate, _ip, egress_bytes, shape

ISLAND_SUBNET = "10.78.{island}"
"""Island ``i``'s bridge: its gateway ``.1``, worker ``j`` ``.(j + 2)``, a /24."""
UPLINK_SUBNET = "10.79.{island}"
"""Island ``i``'s link to the router: the router's end ``.1``, the gateway's ``.2``, a /24."""
UPLINK = "uplink"
"""The gateway's end of its link to the router (shaped towards the router)."""
RENDEZVOUS_PORT = 29400
"""The first island's gateway listens here (the port is the run's own: the namespaces are)."""


def _gateway_address(island: int) -> str:
    return f"{UPLINK_SUBNET.format(island=island)}.2"


class Islands(Namespaces):
    """``islands`` islands of ``per_island`` worker namespaces, joined through a
    router, for a ``with`` block (see the module's docstring and
    :class:`~puredist.demo.links.Namespaces`).

    Attributes:
        router: the router namespace's name.
        gateways: island ``i``'s gateway namespace's name at index ``i`` (its bridge,
            its end of the inter-island link, where its launcher runs).
        workers: ``workers[i][j]``: the namespace of island ``i``'s worker ``j``.
        endpoint: the rendezvous endpoint, ``address:port`` on the inter-island network.
    """

    def __init__(self, islands: int, per_island: int) -> None:
        super().__init__()
        self.router = f"{self.prefix}-router"
        self.gateways = [f"{self.prefix}-i{i}" for i in range(islands)]
        self.workers = [[f"{self.prefix}-i{i}w{j}" for j in range(per_island)] for i in range(islands)]
        self.endpoint = f"{_gateway_address(0)}:{RENDEZVOUS_PORT}"

    def _forward(self, name: str) -> None:
        _ip("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_forward=1")

    def _build(self) -> None:
        self._add(self.router)
        self._forward(self.router)
        for island, gateway in enumerate(self.gateways):
            self._build_island(island, gateway)

    def _build_island(self, island: int, gateway: str) -> None:
        bridge, uplink = ISLAND_SUBNET.format(island=island), UPLINK_SUBNET.format(island=island)
        self._add(gateway)
        self._forward(gateway)
        port = f"i{island}"
        _ip("ip", "-n", self.router, "link", "add", port, "type", "veth", "peer", "name", UPLINK, "netns", gateway)
        _ip("ip", "-n", self.router, "addr", "add", f"{uplink}.1/24", "dev", port)
        _ip("ip", "-n", self.router, "link", "set", port, "up")
        _ip("ip", "-n", gateway, "addr", "add", f"{uplink}.2/24", "dev", UPLINK)
        _ip("ip", "-n", gateway, "link", "set", UPLINK, "up")
        _ip("ip", "-n", gateway, "route", "add", "default", "via", f"{uplink}.1")
        _ip("ip", "-n", self.router, "route", "add", f"{bridge}.0/24", "via", f"{uplink}.2")
        _ip("ip", "-n", gateway, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", gateway, "addr", "add", f"{bridge}.1/24", "dev", "br0")
        _ip("ip", "-n", gateway, "link", "set", "br0", "up")
        for index, name in enumerate(self.workers[island]):
            self._add(name)
            port = f"w{index}"
            _ip("ip", "-n", gateway, "link", "add", port, "type", "veth", "peer", "name", INTERFACE, "netns", name)
            _ip("ip", "-n", gateway, "link", "set", port, "master", "br0", "up")
            _ip("ip", "-n", name, "addr", "add", f"{bridge}.{index + 2}/24", "dev", INTERFACE)
            _ip("ip", "-n", name, "link", "set", INTERFACE, "up")
            _ip("ip", "-n", name, "route", "add", "default", "via", f"{bridge}.1")

    def links(self, island: int) -> list[tuple[str, str]]:
        """Island ``island``'s two shaped directions, as ``(namespace, interface)``:
        out of it (its gateway's egress) and into it (the router's egress towards it)."""
        return [(self.gateways[island], UPLINK), (self.router, f"i{island}")]


def shape_island(links: Sequence[tuple[str, str]], rate: Rate | None) -> None:
    """Shape each of ``links`` (``(namespace, interface)``) to ``rate`` as
    :func:`puredist.demo.links.shape` shapes a worker's egress; None: unshaped."""
    for namespace, interface in links:
        shape(rate, interface, namespace)


def link_bytes(links: Sequence[tuple[str, str]]) -> list[int]:
    """Bytes (Ethernet frames) each of ``links``' queueing disciplines has sent since
    :func:`shape_island` last set it."""
    return [egress_bytes(interface, namespace) for namespace, interface in links]


def launcher_command(islands: Islands, island: int, per_island: int, run_id: str, arguments: Sequence[str]) -> list[str]:
    """The command that starts island ``island``'s workers, in its gateway namespace,
    as one node of an ``islands``-node torchrun job (``arguments``: the worker
    module's)."""
    command = ["ip", "netns", "exec", islands.gateways[island], sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(len(islands.gateways)), "--node-rank", str(island), "--nproc-per-node", str(per_island),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", islands.endpoint, "--rdzv-id", run_id,
               "--local-addr", _gateway_address(island), "--max-restarts", "0", "--monitor-interval", "0.1",
               "--start-method", "spawn"]
    if island == 0:
        command += ["--rdzv-conf", "is_host=1"]
    return command + ["-m", "puredist.demo.island_worker", *arguments]


__all__ = ["Islands", "LinkError", "launcher_command", "link_bytes", "shape_island"]
