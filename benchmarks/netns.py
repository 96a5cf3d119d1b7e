"""Two "hosts" on this machine for the cross-host team tests and benchmarks.team: two network namespaces joined by a veth pair.

:func:`network` makes a private network for one test run: namespaces ``dp-<pid>-srv`` (the server's
machine) and ``dp-<pid>-cli`` (a teammate's), ``lo`` up in both, a veth pair with a /30 of 198.18.0.0/15
(benchmarking addresses, which MLflow does not admit by default, so its allowed-hosts setting is what lets
clients in; the /30 derived from the pid), and no default route: nothing leaves for another network. Each
namespace gets its own ``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over it)
that maps the team's public name, ``team-<pid>.example``, to the server's address, so that clients reach
the servers by name, as a teammate would. :func:`exec_in` runs a command in a namespace.

Leaving :func:`network` ends the processes left in its namespaces (``ip netns pids``: only this run's,
which the test started) and deletes the namespaces, the veth pair and ``/etc/netns/<ns>``. A run killed
before that leaves them behind: the next :func:`network` removes every ``dp-<pid>-*`` whose pid is dead.
:func:`available` says in one line why namespaces cannot be made here (not root, no ``ip``, refused), for a
test's skip reason or the benchmark's fallback to loopback.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
NETWORK = ipaddress.ip_network("198.18.0.0/15")
_NAME = re.compile(r"dp-(\d+)-(srv|cli|probe)")
_LINK = re.compile(r"dp(\d+)[sc]")
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class Network:
    """The two namespaces, their addresses on the veth link, and the public name that maps to the server."""

    server: str
    client: str
    server_address: str
    client_address: str
    name: str  # team-<pid>.example: the server's address in both namespaces' /etc/hosts
    other_name: str  # other-<pid>.example: the same address under a name the servers were not started for


def exec_in(namespace: str, command: list[str] | tuple[str, ...]) -> list[str]:
    """``command`` run in ``namespace`` (its network, its /etc/hosts)."""
    return ["ip", "netns", "exec", namespace, *command]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise OSError(f"ip {' '.join(args)}: {(done.stderr or done.stdout).strip()}")
    return done


def available() -> str | None:
    """None where this process can make network namespaces; else why not, in one line (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not shutil.which("ip"):
        return "network namespaces need iproute2's ip (apt-get install iproute2)"
    probe = f"dp-{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode:
            return f"network namespaces cannot be made here: {(made.stderr or made.stdout).strip().splitlines()[-1]}"
        ran = subprocess.run(exec_in(probe, ["true"]), capture_output=True, text=True, timeout=30)
        if ran.returncode:
            return f"ip netns exec does not work here: {(ran.stderr or 'exit %d' % ran.returncode).strip().splitlines()[-1]}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def _end_processes(namespace: str) -> None:
    """SIGTERM to every process in ``namespace`` (the test's own: nothing else runs there), SIGKILL to those
    left after :data:`STOP_GRACE_S`."""
    pids = _pids(namespace)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while (pids := _pids(namespace)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove(namespace: str) -> None:
    _end_processes(namespace)
    _ip("netns", "del", namespace, check=False)  # its end of the veth pair goes with it, and so the pair
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)


def remove_stale() -> list[str]:
    """Remove what runs that were killed left behind (``dp-<pid>-*`` namespaces, ``/etc/netns`` folders, a
    veth pair not yet moved), where that pid is dead; what was removed."""
    listed = _ip("netns", "list", check=False).stdout.split()
    names = {word for word in listed if _NAME.fullmatch(word)}
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir() if _NAME.fullmatch(p.name)}
    removed = [name for name in sorted(names) if not _alive(int(_NAME.fullmatch(name)[1]))]
    for name in removed:
        _remove(name)
    for link in re.findall(r"^\d+: (dp\d+[sc])[@:]", _ip("-o", "link", "show", check=False).stdout, re.M):
        if not _alive(int(_LINK.fullmatch(link)[1])):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


def _addresses(pid: int) -> tuple[str, str]:
    """The server's and the client's address: a /30 of 198.18.0.0/15 picked by the pid."""
    base = NETWORK.network_address + 4 * (pid % (NETWORK.num_addresses // 4))
    return str(base + 1), str(base + 2)


@contextlib.contextmanager
def network() -> Iterator[Network]:
    """This run's two namespaces, linked (module docstring); everything removed on the way out."""
    pid = os.getpid()
    remove_stale()
    server_address, client_address = _addresses(pid)
    net = Network(server=f"dp-{pid}-srv", client=f"dp-{pid}-cli", server_address=server_address,
                  client_address=client_address, name=f"team-{pid}.example", other_name=f"other-{pid}.example")
    links = (f"dp{pid}s", f"dp{pid}c")
    # this machine's own name too: torch.distributed resolves it to rendezvous (c10d warns, then waits, without it)
    hosts = (f"127.0.0.1 localhost {socket.gethostname()}\n::1 localhost ip6-localhost\n"
             f"{server_address} {net.name} {net.other_name}\n")
    try:
        for namespace, link, own in ((net.server, links[0], server_address), (net.client, links[1], client_address)):
            _ip("netns", "add", namespace)
            (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / namespace / "hosts").write_text(hosts)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for namespace, link, own in ((net.server, links[0], server_address), (net.client, links[1], client_address)):
            _ip("link", "set", link, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{own}/30", "dev", link)
            _ip("-n", namespace, "link", "set", link, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield net
    finally:
        for namespace in (net.client, net.server):
            _remove(namespace)
        for link in links:  # only where the pair was made but not moved
            if _ip("link", "show", link, check=False).returncode == 0:
                _ip("link", "del", link, check=False)
