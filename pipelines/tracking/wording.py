"""How tracking words what it reports: a store's address (:func:`address`, without user or password), what is
wrong with a store (:func:`reason`, :func:`host_refusal`) and counts (:func:`plural`)."""

from __future__ import annotations

import re

from urllib.parse import urlsplit

from ..errors import first_line

NO_ANSWER = "no answer within"
"""How the message of a store call still running at its deadline begins (``store.NoAnswer``)."""


INVALID_HOST = "Invalid Host header"
"""How the body of the 403 begins with which an MLflow server (3.5+) refuses a name it does not admit in the
``Host`` header (``mlflow.server.security_utils.INVALID_HOST_MSG``): not a credentials refusal."""

_USERINFO = re.compile(r"^([A-Za-z][\w+.-]*://)[^/?#]*@")


def address(uri: str) -> str:
    """``uri`` as logged or printed: a user and password in it (``http://user:password@host``) shown as ``***``."""
    return _USERINFO.sub(r"\1***@", uri)


def host_refused(err: BaseException) -> bool:
    """Whether a store call failed because the server does not admit the name it was reached by."""
    return INVALID_HOST in str(err)


def host_refusal(uri: str) -> str:
    """What to do about :func:`host_refused`, in one line naming the server's setting."""
    parts = urlsplit(uri)
    shown = parts.hostname or uri
    base = f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path.rstrip('/')}"
    return (f"refused the name {shown!r} (403 Invalid Host header, not a credentials problem): the server admits only "
            f"the names it was started for; start the server with --public-url {base} "
            "(python -m pipelines.team.mlflow_server), "
            "or add the name to its allowed hosts (mlflow server --allowed-hosts, MLFLOW_SERVER_ALLOWED_HOSTS), or set "
            "MLFLOW_TRACKING_URI to the URL it printed (docs/team.md)")


def credentials_refused(err: BaseException) -> bool:
    """The store answered 401 or 403 for the credentials, not for the name it was reached by (:func:`host_refused`)."""
    status = getattr(err, "get_http_status_code", lambda: None)()
    return not host_refused(err) and (status in (401, 403) or bool(re.search(r"error code 40[13]\b", str(err))))


def reason(err: BaseException) -> str:
    """What is wrong with the store, in a few words, for a warning: ``err`` is what a store call raised."""
    text = str(err)
    if host_refused(err):
        return ("refusing the name this client reached it by (403 Invalid Host header: the server's --public-url / "
                "allowed hosts)")
    if text.startswith(NO_ANSWER):
        return f"not answering ({err})"
    if credentials_refused(err):
        return ("refusing this client's user and password (HTTP 401/403: the user was removed or its password reset "
                "meanwhile; a new team.env from the lead, then make team-join)")
    if "database is locked" in text or "database table is locked" in text:
        return "locked"
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return "not answering (timed out)"
    if re.search(r"refused|Max retries exceeded|Failed to establish|Name or service not known|NameResolution"
                 r"|unable to open database|Connection (aborted|reset)", text, re.IGNORECASE):
        return "unreachable"
    first = first_line(err, 200)
    return f"failing ({type(err).__name__}: {first})" if first else f"failing ({type(err).__name__})"


def plural(n: int, word: str) -> str:
    """``"1 tag"``, ``"3 tags"``."""
    return f"{n} {word}" + ("" if n == 1 else "s")
