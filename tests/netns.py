"""Separate hosts on one machine for the multi-host tests: Linux network namespaces on one bridge, each link shaped.

Each host is a namespace with its own loopback and one veth end (10.N.0.k/24); the other ends hang off one bridge
in the root namespace. `tc tbf` caps each host's rate both ways (this kernel has no netem: the emulated delay is the
project's WAN proxy, run inside the host). Everything made is named with a per-test prefix and removed by `close`,
also after a failure. Creating namespaces needs root (CI runs as root); where it cannot, `Hosts` raises with one
line saying so.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass


class NoNamespaces(RuntimeError):
    """Network namespaces cannot be made here."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NoNamespaces(f"`ip {' '.join(args)}` failed: {done.stderr.strip()} (network namespaces need root and "
                           "iproute2)")


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NoNamespaces(f"`tc {' '.join(args)}` failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    address: str

    def argv(self, *command: str) -> list[str]:
        """`command` run inside this host."""
        return ["ip", "netns", "exec", self.name, *command]


class Hosts:
    """`names` hosts on one bridge, each link capped at `rate` (tbf) both ways."""

    def __init__(self, names: list[str], *, rate: str = "20mbit") -> None:
        if os.geteuid() != 0:
            raise NoNamespaces("the multi-host test makes network namespaces, which needs root (CI runs as root)")
        self.tag = secrets.token_hex(2)
        self.net = 10 + int(self.tag, 16) % 200
        self.bridge = f"nbr{self.tag}"
        self.hosts: dict[str, Host] = {}
        self.made: list[str] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for k, name in enumerate(names, start=1):
                ns, inside, outside = f"nfl{self.tag}-{name}", f"v{self.tag}{k}", f"b{self.tag}{k}"
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                address = f"10.{self.net}.0.{k}"
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
                _ip("-n", ns, "link", "set", inside, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                # the host's rate both ways: its own egress, and the bridge's egress towards it
                _tc("qdisc", "add", "dev", outside, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "400ms")
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inside, "root", "tbf", "rate",
                                rate, "burst", "64kb", "latency", "400ms"], check=True, capture_output=True, timeout=30)
                self.hosts[name] = Host(ns, address)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def close(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)  # its veth goes with it
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, timeout=30)
        self.made = []

    def left(self) -> list[str]:
        """What of this test's is still there (nothing, after close)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
        return ([line.split()[0] for line in listed.splitlines() if line.startswith(f"nfl{self.tag}-")]
                + [word for word in links.split() if word.rstrip(":").startswith(self.bridge)])
