"""``detjac view``'s local HTTP server: the standard library's ``http.server``, GET and HEAD, and one POST.

It serves the page's own files (a fixed list, never a path from the request), and the pages'
data as JSON under ``/api/<key>`` (:class:`~detjac.view.pages.Pages`, which looks keys up and
never opens a path built from them; a key that names no page, one with a number not written in
ASCII digits included, is a 404). A graph file's pages notice the attention files written beside it after the server
started (:class:`LiveGraph`). Every other method is refused, nothing is written. Bound
to a loopback address, it also refuses requests whose ``Host`` is not that address (a page on
another site cannot reach it by DNS rebinding).

The one POST, ``/api/intervene``, answers interventions (docs/graphs.md, "Interventions") through the callable the
server was made with (``interventions``: runs/ gives it when the viewer is started with ``--model``; the viewer never
imports torch). Its body must be JSON sent as ``application/json`` (which a page on another site cannot send without
a preflight that is refused), at most :data:`MAX_BODY` bytes; answers and errors are JSON. It writes nothing.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ..errors import DetjacError, InvalidArgumentError
from .assets import ASSETS, asset, data_script, index_html
from .graph_file import GraphFile, beside
from .pages import NotFound, Pages

if TYPE_CHECKING:
    from ..store import NeuronIndex, StoreReader

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address in any form the system resolves, ``127.1`` included) only reaches
    this machine: every address it resolves to is a loopback one."""
    host = host.strip("[]")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    try:
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    except ValueError:
        return False


# Connections: a request's line and headers must arrive within this many seconds, and at most this many are
# served at once (more are closed at once): half-open connections cannot hold threads for ever.
REQUEST_TIMEOUT_S = 10.0
# A body is sent a chunk at a time: the socket's timeout bounds each ``sendall`` as a whole, so one of a large body
# (a graph of 500 MB) to a slow or busy reader would be cut short midway under a full Content-Length. Per chunk, it
# is an idle timeout: a reader that takes nothing for REQUEST_TIMEOUT_S is dropped, a slow one is served whole.
SEND_CHUNK = 64 * 1024
MAX_CONNECTIONS = 64
QUIET_ERRORS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)
MAX_BODY = 64 * 1024  # an intervention request: a group of edits, far below this
NO_INTERVENTIONS = ("Interventions need the live viewer started with the model: detjac view GRAPH.json --model "
                    "MODEL.")


class LiveGraph:
    """A graph file's pages (:class:`~detjac.view.graph_file.GraphFile`) that notice the attention files written
    beside it after they were read (``detjac attention --graph``, ``detjac graph --attention-pages``).

    :meth:`refresh`, which the server calls before each page's data, lists ``STEM.qk.*.json`` beside the graph (names,
    sizes and modification times: nothing is read) and, when that changed, reads the graph and every attention file
    again (``attention``: those given with it, read again too), so a reloaded page links the new heads. A file refused
    then (damaged, of another model or prompt) is the error of every page until it is removed or fixed, never numbers.
    """

    def __init__(self, graph: GraphFile, attention: Sequence[str | Path] = ()) -> None:
        self.current, self.given = graph, list(attention)
        self.lock = threading.Lock()  # one re-read at a time; the pages in use are swapped whole
        self.seen, self.failed = self._listing(), None

    def _listing(self) -> dict[str, tuple[int, int]]:
        found = {}
        for path in beside(self.current.path):
            try:
                stat = path.stat()
            except OSError:  # removed between the listing and the stat: not there
                continue
            found[path.name] = (stat.st_mtime_ns, stat.st_size)
        return found

    def refresh(self) -> bool:
        """Read the graph and its attention files again if the files beside it changed; whether it did.

        Raises
        ------
        DetjacError
            An attention file beside the graph is refused (until the files change again).
        """
        with self.lock:
            listing = self._listing()
            if listing != self.seen:
                self.seen, self.failed = listing, None
                try:
                    self.current = GraphFile(self.current.path, self.given)
                except DetjacError as exc:
                    self.failed = exc
                else:
                    return True
            if self.failed is not None:
                raise self.failed
            return False

    def __len__(self) -> int:
        return len(self.current)

    def __getattr__(self, name: str) -> Any:  # everything else is the current pages'
        return getattr(self.current, name)

    def data(self, key: str) -> dict[str, Any]:
        return self.current.data(key)

    def keys(self, prompt_ids: list[str] | None = None) -> list[str]:
        return self.current.keys(prompt_ids)


class ViewServer(ThreadingHTTPServer):
    """Serves one store's pages; ``url`` is where a browser finds them."""

    daemon_threads = True

    def __init__(self, pages: Pages | GraphFile | LiveGraph, host: str, port: int,
                 interventions: Callable[[Any], dict[str, Any]] | None = None) -> None:
        self.pages, self.interventions = pages, interventions
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((host.strip("[]"), port), ViewHandler)
        self.port = self.server_address[1]
        bound = str(self.server_address[0])
        self.loopback = is_loopback(bound)  # what was bound, however the host was written
        shown = f"[{host.strip('[]')}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/"
        names = {shown, f"[{bound}]" if ":" in bound else bound, "localhost", "127.0.0.1", "[::1]"}
        self.allowed_hosts = {f"{name}:{self.port}" for name in names}

    def process_request(self, request: Any, client_address: Any) -> None:
        """One thread per connection while fewer than ``MAX_CONNECTIONS`` are open; a connection beyond is closed."""
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (broken pipe, reset, timeout) is not an error of the server: nothing printed."""
        if isinstance(sys.exc_info()[1], QUIET_ERRORS):
            return
        super().handle_error(request, client_address)


class ViewHandler(BaseHTTPRequestHandler):
    server: ViewServer
    timeout = REQUEST_TIMEOUT_S  # the socket's: a silent client is dropped, its thread freed
    def version_string(self) -> str:
        return "detjac-view"


    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _refuse_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b'{"error": "read-only: only GET and HEAD"}',
                   "application/json", body=True, extra={"Allow": "GET, HEAD"})

    def do_POST(self) -> None:  # noqa: N802
        if urlsplit(self.path).path != "/api/intervene":
            self._refuse_method()
        elif self.server.loopback and self.headers.get("Host") not in self.server.allowed_hosts:
            self._send(HTTPStatus.FORBIDDEN, b'{"error": "unexpected Host header"}', "application/json", True)
        else:
            status, data = self._intervene()
            self._send(status, json.dumps(data, allow_nan=False).encode(), "application/json", True)

    def _intervene(self) -> tuple[HTTPStatus, dict[str, Any]]:
        """The intervention answer to this request's body, or (status, ``{"error": message}``)."""
        kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        length = self.headers.get("Content-Length", "")
        if kind != "application/json":
            return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": f"Expected a body of type application/json. Got "
                                                                f"{kind[:60] or 'none'!r} instead."}
        if not (length.isascii() and length.isdigit()) or int(length) > MAX_BODY:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"Expected a body of at most {MAX_BODY} bytes with "
                                                                  f"its Content-Length. Got {length[:20]!r} instead."}
        raw = self.rfile.read(int(length))
        if self.server.interventions is None:
            return HTTPStatus.NOT_FOUND, {"error": NO_INTERVENTIONS}
        try:
            body = json.loads(raw)
        except ValueError as exc:  # not UTF-8 or not JSON
            return HTTPStatus.BAD_REQUEST, {"error": f"Expected a JSON body. Got one that does not parse ({exc})."}
        try:
            return HTTPStatus.OK, self.server.interventions(body)
        except DetjacError as exc:
            return HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the page shows the message; the terminal the traceback
            traceback.print_exc(file=sys.stderr)
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"}

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        """Quiet: the terminal shows the URL and errors, not every request."""

    def _answer(self, body: bool) -> None:
        if self.server.loopback and self.headers.get("Host") not in self.server.allowed_hosts:
            self._send(HTTPStatus.FORBIDDEN, b'{"error": "unexpected Host header"}', "application/json", body)
            return
        _, _, path, query, _ = urlsplit(self.path)
        if path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, index_html("server"), "text/html; charset=utf-8", body)
        elif path.lstrip("/") in ASSETS:
            name = path.lstrip("/")
            self._send(HTTPStatus.OK, asset(name), f"{ASSETS[name]}; charset=utf-8", body)
        elif path.startswith("/api/"):
            self._api(path.removeprefix("/api/"), body, script=query == "js")
        else:
            self._send(HTTPStatus.NOT_FOUND, b'{"error": "not found"}', "application/json", body)

    def _api(self, key: str, body: bool, script: bool = False) -> None:
        """The page ``key``'s data as JSON, or (``script``: ``/api/KEY?js``) as the script the page loads
        (:func:`~detjac.view.assets.data_script`; an error is passed in it, with status 200 so that it runs)."""
        try:
            if not key.isascii():  # every page's key is ASCII: a Unicode digit ('²') never reaches a parser
                raise NotFound(key)
            self.server.pages.refresh()  # the folder may hold another store by now (run --force-new)
            status, data = HTTPStatus.OK, self.server.pages.data(key)
        except NotFound:
            status, data = HTTPStatus.NOT_FOUND, {"error": f"no page {key!r} in this store"}
        except DetjacError as exc:
            status, data = HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the page shows the message; the terminal the traceback
            traceback.print_exc(file=sys.stderr)
            status, data = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"}
        if script:
            error = data["error"] if status != HTTPStatus.OK else None
            self._send(HTTPStatus.OK, data_script(unquote(key), data, error), "text/javascript; charset=utf-8", body)
            return
        self._send(status, json.dumps(data, allow_nan=False).encode(), "application/json", body)

    def _send(self, status: HTTPStatus, data: bytes, kind: str, body: bool,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        headers = {"Content-Type": kind, "Content-Length": str(len(data)), "Cache-Control": "no-store",
                   "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                   "Content-Security-Policy": CSP, **(extra or {})}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            view = memoryview(data)
            for start in range(0, len(view), SEND_CHUNK):  # the socket's timeout applies to each chunk
                self.wfile.write(view[start:start + SEND_CHUNK])


def make_server(store: StoreReader | GraphFile, host: str = "127.0.0.1", port: int = 0,
                neurons: NeuronIndex | None = None, attention: Sequence[str | Path] = (),
                interventions: Callable[[Any], dict[str, Any]] | None = None) -> ViewServer:
    """A server of ``store``'s pages (or of one graph file's, noticing attention files written beside it later:
    :class:`LiveGraph`, ``attention`` the files given with it) on ``host``:``port`` (0: a free port), not yet
    serving; with ``neurons`` (a neuron index of the same model), its neuron pages too
    (:class:`~detjac.view.neuron_page.NeuronPages`; another model's index is refused by name); with
    ``interventions`` (a request body -> a JSON-able answer, raising DetjacError for a bad one), the
    ``/api/intervene`` POST.

    Raises
    ------
    InvalidArgumentError
        ``host``:``port`` cannot be listened on (taken, not an address of this machine, ...).
    """
    try:
        pages: Any = LiveGraph(store, attention) if isinstance(store, GraphFile) else Pages(store)
        if neurons is not None:
            from .neuron_page import NeuronPages

            pages = NeuronPages(pages, neurons)
        return ViewServer(pages, host, port, interventions)
    except OSError as exc:
        raise InvalidArgumentError(f"Expected a host and port this machine can listen on. Got {host}:{port} "
                                   f"({exc.strerror or exc}).") from exc
