"""The viewer's server against clients that misbehave: loopback however it is written (``127.1``), connections that
send nothing, more connections than it serves at once, and clients that go away mid-answer."""

from __future__ import annotations

import http.client
import io
import socket
import sys
import threading
import time
from contextlib import contextmanager, redirect_stderr

import pytest

from detjac.view import server as view_server
from detjac.view.headless import Served
from detjac.view.server import is_loopback, make_server


@contextmanager
def serving(store, **limits):
    """An in-process server of ``store`` on a free loopback port, with ``limits`` (module constants) patched."""
    patch = pytest.MonkeyPatch()
    for name, value in limits.items():
        patch.setattr(view_server, name, value)
    if "REQUEST_TIMEOUT_S" in limits:
        patch.setattr(view_server.ViewHandler, "timeout", limits["REQUEST_TIMEOUT_S"])
    server = make_server(store.open())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        patch.undo()


def status(server, path: str = "/api/corpus", host: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", path, headers={"Host": host or f"127.0.0.1:{server.port}"})
    code = conn.getresponse().status
    conn.close()
    return code


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` (recv gives b"") within ``seconds``."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_loopback_written_any_way_is_loopback(layered_store):
    assert is_loopback("127.1") and is_loopback("127.0.0.2") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("no-such-host.invalid")
    server = Served(layered_store.path, "--host", "127.1")
    try:
        port = server.url.rsplit(":", 1)[1].strip("/")
        conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=10)
        conn.request("GET", "/api/corpus", headers={"Host": f"evil.example:{port}"})
        assert conn.getresponse().status == 403  # the Host check is on: 127.1 is this machine only
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=10)
        conn.request("GET", "/api/corpus", headers={"Host": f"127.1:{port}"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        err = server.stop()
    assert "not a loopback address" not in err


def test_a_connection_that_sends_nothing_is_dropped(layered_store):
    with serving(layered_store, REQUEST_TIMEOUT_S=0.5) as server:
        idle = socket.create_connection(("127.0.0.1", server.port))
        half = socket.create_connection(("127.0.0.1", server.port))
        half.sendall(b"GET /api/corpus HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
        assert closed_within(idle, 5) and closed_within(half, 5)
        idle.close()
        half.close()
        assert status(server) == 200


def test_connections_beyond_the_limit_are_closed_and_the_server_recovers(layered_store):
    with serving(layered_store, REQUEST_TIMEOUT_S=1.0, MAX_CONNECTIONS=3) as server:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        time.sleep(0.2)  # the three are accepted and each holds a thread
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert closed_within(extra, 0.8)  # closed at once, before the held ones time out
        extra.close()
        threads = threading.active_count()
        assert all(closed_within(s, 5) for s in held)
        for s in held:
            s.close()
        time.sleep(0.2)
        assert status(server) == 200 and threading.active_count() <= threads


def test_a_client_that_goes_away_prints_no_traceback(layered_store):
    with serving(layered_store) as server:
        err = io.StringIO()
        with redirect_stderr(err):
            for exc in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset"), TimeoutError()):
                try:
                    raise exc
                except OSError:
                    server.handle_error(None, ("127.0.0.1", 1))
            for _ in range(20):  # real clients hanging up on a large answer
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.sendall(f"GET /app.js HTTP/1.0\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.close()  # a reset, not a polite close
            time.sleep(0.3)
            try:
                raise ValueError("a real error")
            except ValueError:
                server.handle_error(None, ("127.0.0.1", 1))
        assert "Traceback" in err.getvalue() and "a real error" in err.getvalue()
        assert "BrokenPipe" not in err.getvalue() and "ConnectionReset" not in err.getvalue()
        assert status(server) == 200
        assert sys.stderr is not err


def test_a_store_replaced_under_a_running_viewer_is_read_anew(tmp_path):
    """``run --force-new`` puts another store (another model) in the folder: the next request is answered from it,
    never from the first store's model matrices or prompt list; a folder that no longer holds a store is an
    error, not stale pages."""
    import json
    import shutil
    import urllib.request

    from view_helpers import TEXTS

    from detjac.store.testing import make_store
    from detjac.view.pages import Pages

    first = make_store(tmp_path / "first.zarr", prompts=TEXTS[:2], d_model=8, seed=1)
    second = make_store(tmp_path / "second.zarr", prompts=TEXTS[2:], d_model=8, seed=2)
    folder = tmp_path / "served.zarr"
    shutil.copytree(first.path, folder)

    class Synthetic:  # serving() takes something with .open()
        @staticmethod
        def open():
            from detjac.store import open_store

            return open_store(folder)

    def get(server, key):
        url = f"http://127.0.0.1:{server.port}/api/{key}"
        request = urllib.request.Request(url, headers={"Host": f"127.0.0.1:{server.port}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    with serving(Synthetic) as server:
        code, corpus = get(server, "corpus")
        assert code == 200 and sorted(r["id"] for r in corpus["prompts"]) == sorted(first.ids)
        assert get(server, f"prompt/{first.ids[0]}/operator/combined")[0] == 200
        shutil.rmtree(folder)
        code, error = get(server, "corpus")
        assert code == 422 and "Expected a detjac store" in error["error"]
        shutil.copytree(second.path, folder)
        code, corpus = get(server, "corpus")
        assert code == 200 and sorted(r["id"] for r in corpus["prompts"]) == sorted(second.ids)
        assert get(server, f"prompt/{first.ids[0]}")[0] == 404
        key = f"prompt/{second.ids[0]}/operator/combined"
        from detjac.store import open_store

        assert get(server, key) == (200, json.loads(json.dumps(Pages(open_store(second.path)).data(key))))


class _BigPages:
    """Pages whose one key is a JSON body of a few MB."""

    def refresh(self) -> bool:
        return False

    def data(self, key: str) -> dict:
        return {"blob": "x" * (8 << 20)}


def _slow_read(port: int, path: str) -> tuple[int, int]:
    """(Content-Length, bytes read) of ``path``, read 32 KiB at a time with pauses (a slow reader)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
    sock.settimeout(10)
    raw = b""
    while True:
        piece = sock.recv(32 * 1024)
        if not piece:
            break
        raw += piece
        time.sleep(0.008)
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return length, len(body)


def test_a_large_body_to_slow_readers_at_once_is_sent_whole(monkeypatch):
    readers = 2
    monkeypatch.setattr(view_server.ViewHandler, "timeout", 0.4)  # far less than the whole body takes
    server = view_server.ViewServer(_BigPages(), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got: list[tuple[int, int]] = []
        threads = [threading.Thread(target=lambda: got.append(_slow_read(server.port, "/api/big")))
                   for _ in range(readers)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert time.perf_counter() - started > 0.4  # the reads took longer than the timeout
        assert len(got) == readers and all(length == read > 8 << 20 for length, read in got), got
    finally:
        server.shutdown()
        server.server_close()


def test_a_pages_data_as_a_script_is_its_json_and_an_error_is_passed_to_the_page(layered_store):
    import json
    import re

    def get(server, path):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", path, headers={"Host": f"127.0.0.1:{server.port}"})
        answer = conn.getresponse()
        got = answer.status, answer.getheader("Content-Type"), answer.read().decode()
        conn.close()
        return got

    with serving(layered_store) as server:
        code, kind, body = get(server, "/api/corpus?js")  # what the page loads: a script delays its load event
        assert code == 200 and kind.startswith("text/javascript")
        found = re.fullmatch(r'detjacData\("corpus", (.*)\);\n', body, re.DOTALL)
        assert found and json.loads(found.group(1)) == json.loads(get(server, "/api/corpus")[2])
        code, kind, body = get(server, "/api/prompt/nope?js")  # 200, so that the script runs and the page says why
        assert get(server, "/api/prompt/nope")[0] == 404 and code == 200
        assert body == 'detjacData("prompt/nope", null, "no page \'prompt/nope\' in this store");\n'


def raw_get(port: int, target: bytes) -> tuple[int, bytes]:
    """The status and body of ``GET target``, its bytes sent as they are (a client that does not percent-encode: the
    server reads the byte 0xB2 as '²')."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET " + target + f" HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while piece := sock.recv(65536):
            raw += piece
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_number_in_the_path_not_in_ascii_digits_is_a_404(layered_store):
    pid = layered_store.ids[0]
    err = io.StringIO()
    with serving(layered_store) as server, redirect_stderr(err):
        assert raw_get(server.port, f"/api/prompt/{pid}/operator/0".encode())[0] == 200
        for segment in (b"\xb2", b"1\xb2", "٣".encode(), b"%C2%B2", b"01", b"-1", b"99999999999999999999"):
            code, body = raw_get(server.port, f"/api/prompt/{pid}/operator/".encode() + segment)
            assert code == 404 and b"no page" in body, (segment, code, body)
    assert "Traceback" not in err.getvalue()


def test_a_neuron_page_not_in_ascii_digits_is_a_404(graph_file, neuron_index):
    from detjac.store import open_neuron_index
    from detjac.view import GraphFile

    err = io.StringIO()
    server = make_server(GraphFile(graph_file), neurons=open_neuron_index(neuron_index))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with redirect_stderr(err):
            assert raw_get(server.port, b"/api/neuron/0/5")[0] == 200
            for target in (b"/api/neuron/\xb2/5", b"/api/neuron/0/\xb2", "/api/neuron/٣/5".encode(),
                           b"/api/neuron/\xb2/5?js"):
                code, body = raw_get(server.port, target)
                assert code == (200 if target.endswith(b"?js") else 404) and b"no page" in body, (target, code, body)
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in err.getvalue()
