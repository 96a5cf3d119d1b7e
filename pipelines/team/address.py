"""Where a team server listens apart from where its clients reach it (docs/team.md).

``--host`` is the bind address, an address of the server's own machine (127.0.0.1, or 0.0.0.0 for all); it
means nothing on a teammate's machine. ``--public-url`` is the advertised address, the URL teammates use
(``http://tracking.example:5000``, or a TLS proxy's ``https://tracking.example``): every printed tracking URI
and ``endpointurl`` line is it, and the MLflow server admits its name in the ``Host`` header (MLflow refuses
any other name with a 403 "Invalid Host header", its guard against DNS rebinding). Without ``--public-url``
it is ``http://HOST:PORT``, with this machine's host name for a wildcard ``--host``.

:func:`public_url` checks it as it is read; :func:`allowed_hosts` and :func:`origin` are what the MLflow
server is given; :func:`local_url` is how this machine reaches the server (health checks, admin commands);
:func:`is_loopback` decides whether a server is reachable from other machines at all.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
from urllib.parse import urlsplit

WILDCARDS = ("0.0.0.0", "::", "")
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")  # always admitted: the server's own machine
DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")  # a DNS name
EXPECTED = "expected http(s)://NAME[:PORT][/PATH], the address teammates reach the server at"


def public_url(text: str) -> str:
    """``--public-url``: an ``http``/``https`` URL of a name or address, an optional port (1-65535) and path, no
    user or password, query or fragment (argparse type); returned without the scheme's default port or a
    trailing ``/``."""
    parts = urlsplit(text.strip())
    if parts.scheme not in DEFAULT_PORTS or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL; {EXPECTED}")
    if "@" in parts.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} carries a user or password (user:password@): a printed address "
                                         f"must not; {EXPECTED}")
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} has a query or fragment; {EXPECTED}")
    try:
        port = parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: its port is not one of 1-65535; {EXPECTED}") from None
    if port == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: its port is not one of 1-65535; {EXPECTED}")
    host = parts.hostname or ""
    if not (_is_ip(host) or _NAME.fullmatch(host)) or (":" in host and not parts.netloc.startswith("[")):
        raise argparse.ArgumentTypeError(f"{text!r}: {host!r} is not a host name or address; {EXPECTED}")
    if host in WILDCARDS or (_is_ip(host) and ipaddress.ip_address(host).is_unspecified):
        raise argparse.ArgumentTypeError(f"{text!r}: {host} is a bind address (all of this machine's), not one "
                                         f"clients can reach; {EXPECTED}")
    netloc = _bracketed(host.lower()) + ("" if port in (None, DEFAULT_PORTS[parts.scheme]) else f":{port}")
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def unreachable_note(public: str, option: str = "--public-url", timeout: float = 3.0) -> str | None:
    """One ``note:`` line where this machine cannot reach the server it just started at its public URL: the name
    does not resolve here, or nothing answers there (a typo, or the name of another machine). Not an error: a
    name that only teammates' resolvers know, or a proxy reachable from outside only, is a valid set-up; but a
    teammate whose ``team.env`` carries a wrong name is refused at ``make team-join`` with "does not answer"."""
    parts = urlsplit(public)
    host, port = parts.hostname or "", parts.port or DEFAULT_PORTS[parts.scheme]
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return (f"note: {option} {public}: {host} does not resolve on this machine; teammates' machines must resolve "
                "it to this one (DNS or /etc/hosts), or their make team-join stops with 'does not answer'")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return (f"note: {option} {public}: nothing answers there from this machine ({err.strerror or err}); check "
                "that the name is this machine's, or that the proxy in front forwards to it")
    return None


def default_public_url(host: str, port: int) -> str:
    """The advertised URL without ``--public-url``: ``http://HOST:PORT``, this machine's name for a wildcard."""
    return f"http://{_bracketed(socket.gethostname() if host in WILDCARDS else host)}:{port}"


def reach(host: str) -> str:
    """The address this machine connects to for a server bound to ``host``: a loopback one for a wildcard."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def local_url(host: str, port: int) -> str:
    """How this machine reaches a server bound to ``host`` (:func:`reach`)."""
    return f"http://{_bracketed(reach(host))}:{port}"


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (a server bound to it is unreachable from
    other machines); a wildcard is not."""
    if host in WILDCARDS:
        return False
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in found)


def host_headers(url: str) -> list[str]:
    """The ``Host`` headers a client of ``url`` sends: ``name:port``, and ``name`` alone where the port is the
    scheme's default (HTTP clients leave it out then)."""
    parts = urlsplit(url)
    name, port = _bracketed(parts.hostname or ""), parts.port
    default = DEFAULT_PORTS.get(parts.scheme)
    if port is None or port == default:
        return [name, f"{name}:{default}"]
    return [f"{name}:{port}"]


def _pattern(host: str) -> str:
    """``host:*`` as an fnmatch pattern (MLflow matches patterns with ``*`` by fnmatch): ``[`` escaped."""
    return host.replace("[", "[[]", 1) + ":*"


def allowed_hosts(public: str, *, host: str, port: int) -> str:
    """MLflow's ``--allowed-hosts``: the public URL's name, this machine's loopback names, and the bind address
    (any port) unless it is a wildcard. Nothing else: not MLflow's default private-network patterns."""
    names = list(host_headers(public))
    for own in (*LOOPBACK, *(() if host in WILDCARDS else (_bracketed(host),))):
        names += [own, _pattern(own)]
    return ",".join(dict.fromkeys(names))


def origin(url: str) -> str:
    """The origin (``scheme://host[:port]``) of ``url``: the UI served there sends it with its writes, which
    MLflow refuses from an origin it was not given (``--cors-allowed-origins``)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
