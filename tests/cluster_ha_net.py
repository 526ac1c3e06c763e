"""A small LAN of network namespaces for the cluster tests: hosts on one bridge, each cable pullable.

Runs in the pytest process (as root). Owns `Lan`: a bridge in a namespace of its own (a switch:
a fresh namespace has no firewall rules, so bridged traffic passes whatever the machine's own
iptables say), one namespace per host plugged into it by a veth pair, and the test's own
namespace plugged in too, so the test process, HAProxy and anything else left here reach every
host. `Host.cut()` sets the host's switch port down (the cable is pulled: packets vanish, no
reset is sent) and `Host.mend()` sets it up again. Addresses are 10.214.N.0/24, N picked unused.
Without root or iproute2 the test is skipped, saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass

import pytest


def _ip(*args: str, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=20)


def _unused_subnet() -> str:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout
    for n in range(int(uuid.uuid4().hex[:2], 16), 256 * 2):
        subnet = f"10.214.{n % 256}"
        if f" {subnet}." not in used:
            return subnet
    pytest.skip("no free 10.214.N.0/24 subnet for the test's network")


@dataclass
class Host:
    """One machine of the LAN: a namespace and an address on the bridge."""

    name: str
    netns: str
    ip: str
    switch: str  # the switch namespace
    port: str  # its switch port (the veth end on the bridge)

    def command(self, *argv: str) -> list[str]:
        """argv run on this host (`ip netns exec` execs it: the process id is the command's own)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def cut(self) -> None:
        _ip("link", "set", self.port, "down", netns=self.switch)

    def mend(self) -> None:
        _ip("link", "set", self.port, "up", netns=self.switch)


class Lan:
    """Use as a context manager; everything it made is removed on exit, whatever happened."""

    def __init__(self) -> None:
        if shutil.which("ip") is None or os.geteuid() != 0:
            pytest.skip("network namespaces need root and iproute2 (ip)")
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"llmha-{self.tag}-sw"
        self.subnet = _unused_subnet()
        self.gateway_ip = f"{self.subnet}.1"  # this namespace's address on the LAN
        self._namespaces: list[str] = []
        self._root_end = f"lha{self.tag}"
        self._ports = 0

    def __enter__(self) -> Lan:
        try:
            _ip("netns", "add", self.switch)
        except (subprocess.CalledProcessError, OSError) as exc:
            pytest.skip(f"cannot create a network namespace here: {getattr(exc, 'stderr', exc)!r}")
        self._namespaces.append(self.switch)
        try:
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            self._plug(self._root_end)
            _ip("addr", "add", f"{self.gateway_ip}/24", "dev", self._root_end)
            _ip("link", "set", self._root_end, "up")
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _plug(self, end: str) -> str:
        """A veth pair: `end` stays where it is made, its peer becomes a port of the bridge."""
        self._ports += 1
        port = f"p{self._ports}-{self.tag}"
        _ip("link", "add", end, "type", "veth", "peer", "name", port)
        _ip("link", "set", port, "netns", self.switch)
        _ip("link", "set", port, "master", "br0", netns=self.switch)
        _ip("link", "set", port, "up", netns=self.switch)
        return port

    def add_host(self, name: str, number: int) -> Host:
        """Host `name` at SUBNET.`number` (2..254)."""
        netns = f"llmha-{self.tag}-{name}"
        _ip("netns", "add", netns)
        self._namespaces.append(netns)
        end = f"h{number}-{self.tag}"
        port = self._plug(end)
        ip = f"{self.subnet}.{number}"
        _ip("link", "set", end, "netns", netns)
        _ip("addr", "add", f"{ip}/24", "dev", end, netns=netns)
        _ip("link", "set", end, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        return Host(name, netns, ip, self.switch, port)

    def __exit__(self, *exc_info: object) -> None:
        # Deleting a namespace deletes the veth ends in it, and with them their peers.
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=20)
        self._namespaces.clear()
        subprocess.run(["ip", "link", "del", self._root_end], capture_output=True, timeout=20)
