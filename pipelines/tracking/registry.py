"""The MLflow model registry, within bounds, for the commands that need it (``stages.register``, and
``stages.predict`` with a ``models:/`` model): every call either answers or fails in one line.

Unlike a stage's tracking (:mod:`.tracker`), which never stops a stage, these commands cannot do their
work without the registry: a store that cannot be reached, or a registered model, version or alias that
does not exist, is a :class:`~pipelines.errors.TrackingError` (exit 2) naming the store or the model.
Calls are bounded as the store's are (:mod:`.store`): each runs in a worker thread waited on for at
most :data:`~.store.CALL_TIMEOUT` seconds, with MLflow's HTTP retries shortened.

``models:/`` URIs name a version as ``models:/<name>/<version>`` or ``models:/<name>@<alias>``
(:func:`parse_model_uri`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from ..errors import TrackingError, first_line
from . import store
from .wording import address, reason

MODELS_SCHEME = "models:/"
_NAME = r"[^/@]+"
_URI = re.compile(rf"models:/+(?P<name>{_NAME})(?:/(?P<version>\d+)|@(?P<alias>[^/@]+))/?")


def is_model_uri(text: str) -> bool:
    """Whether ``text`` is a ``models:/`` URI."""
    return str(text).startswith("models:")


def parse_model_uri(uri: str) -> tuple[str, str]:
    """``(name, version or alias)`` of ``models:/<name>/<version>`` or ``models:/<name>@<alias>``.

    Raises:
        TrackingError: another form (one line with the expected ones).
    """
    match = _URI.fullmatch(str(uri))
    if match is None:
        raise TrackingError(f"{uri}: expected models:/<name>@<alias> or models:/<name>/<version>, "
                            "e.g. models:/detector@champion")
    return match["name"], match["version"] or match["alias"]


class Registry:
    """The registry of the MLflow store at ``uri`` (default: the project's, :func:`~.store.tracking_uri`).

    ``create``: whether a SQLite store that does not exist yet may be created (registering); reading
    from one that does not exist is an error.

    Raises:
        TrackingError: the store cannot be opened (one line).
    """

    def __init__(self, uri: str | None = None, *, create: bool = False):
        self.uri = uri or store.tracking_uri()
        store.refuse_file_store(self.uri)
        if not create and self.uri.startswith("sqlite:///") and not Path(self.uri[len("sqlite:///"):]).is_file():
            raise TrackingError(f"MLflow store {address(self.uri)}: no such database (no model has been registered "
                                "here)")
        try:
            store.open_client(self.uri, store.OPEN_TIMEOUT)  # bounded: opens (maybe creates) the store
            import mlflow

            # its registry named explicitly: MLflow's default is the process-wide registry URI, which an
            # earlier set_registry_uri in this process may have pointed elsewhere
            self.client = mlflow.MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        except Exception as err:
            raise TrackingError(f"MLflow store {address(self.uri)} {reason(err)}") from None

    @property
    def shown(self) -> str:
        """The store's URI as logged: without a user or password in it."""
        return address(self.uri)

    def call(self, fn: Callable[[Any], Any], *, timeout: float | None = None, missing: bool = False) -> Any:
        """``fn(client)`` within ``timeout`` seconds (default :data:`~.store.CALL_TIMEOUT`). With ``missing``,
        None where the store answers that what was asked for does not exist.

        Raises:
            TrackingError: the store is unreachable, does not answer in time, refuses the credentials, or
                (without ``missing``) refuses the request (one line).
        """
        try:
            return store.Attempt(lambda: fn(self.client)).wait(store.CALL_TIMEOUT if timeout is None else timeout)
        except Exception as err:
            if store.rejected(err):
                if missing:
                    return None
                raise TrackingError(f"MLflow store {address(self.uri)} refused the request "
                                    f"({first_line(err, 300)})") from None
            raise TrackingError(f"MLflow store {address(self.uri)} {reason(err)}") from None

    def version(self, name: str, ref: str):
        """The ``ModelVersion`` of registered model ``name`` that ``ref`` names (a version number or an
        alias), None if the model, the version or the alias does not exist."""
        if ref.isdigit():
            return self.call(lambda client: client.get_model_version(name, ref), missing=True)
        return self.call(lambda client: client.get_model_version_by_alias(name, ref), missing=True)

    def resolve(self, uri: str):
        """The ``ModelVersion`` that a ``models:/`` URI names.

        Raises:
            TrackingError: a malformed URI; no such registered model, version or alias; store problems.
        """
        name, ref = parse_model_uri(uri)
        found = self.version(name, ref)
        if found is not None:
            return found
        if self.call(lambda client: client.get_registered_model(name), missing=True) is None:
            raise TrackingError(f"{uri}: no registered model {name!r} in MLflow store {address(self.uri)}")
        what = f"version {ref}" if ref.isdigit() else f"alias {ref!r}"
        raise TrackingError(f"{uri}: registered model {name!r} has no {what} (python -m stages.register "
                            "registers versions; --promote sets aliases)")
