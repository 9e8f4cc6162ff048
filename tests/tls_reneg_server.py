"""A hostile TLS peer for a data channel, in a thread of the test process (no subprocess, no fixed port).

It accepts one connection the way an endpoint does (the ``AIOTD`` preamble, the ``G`` answer, then TLS 1.2 at
most), asks for a renegotiation (a HelloRequest, through libssl's ``SSL_renegotiate``, which Python does not
offer) and leaves it hanging, so that a client which allows renegotiation answers its own ``SSL_write`` with
WANT_READ: asyncio's and uvloop's TLS layers then keep the plaintext written, views of the caller's memory, in
their write backlog. After :meth:`RenegServer.go` it reads what the client sent (completing the renegotiation
if the client took part) for up to ``limit_s``; :meth:`RenegServer.received` returns it.

Made for ``tests/test_tls_contexts.py`` (ported from the audit's ``_reneg_server.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
import ssl
import threading
import time


def _ssl_pointer(tls: ssl.SSLSocket) -> int:
    """The ``SSL *`` of a CPython ``PySSLSocket`` (after its object header and its socket reference)."""
    pointer = ctypes.c_void_p.from_address(id(tls._sslobj) + 3 * ctypes.sizeof(ctypes.c_void_p)).value  # type: ignore[attr-defined]
    assert pointer, "no SSL object"
    return pointer


def _libssl() -> ctypes.CDLL:
    """The libssl that ``_ssl`` uses (its handle resolves its dependencies' symbols)."""
    for name in (getattr(ssl._ssl, "__file__", None), None, ctypes.util.find_library("ssl")):  # type: ignore[attr-defined]
        try:
            library = ctypes.CDLL(name)
            library.SSL_renegotiate  # noqa: B018  # present?
            return library
        except (OSError, AttributeError):
            continue
    raise RuntimeError("libssl's SSL_renegotiate not found")


class RenegServer:
    """Listens on 127.0.0.1 (any port); serves one data connection in a thread."""

    def __init__(self, cert_file: str, key_file: str, *, renegotiate: bool, expect: int,
                 limit_s: float = 5.0) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert_file, key_file)
        self.context.maximum_version = ssl.TLSVersion.TLSv1_2  # renegotiation exists up to TLS 1.2
        self.renegotiate = renegotiate
        self.limit_s = limit_s
        self.expect = expect  # stop reading after this many bytes
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(limit_s)
        self.port: int = self.listener.getsockname()[1]
        self.asked = threading.Event()  # the HelloRequest was sent (or, without renegotiate, TLS is up)
        self._go = threading.Event()
        self._got = bytearray()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="reneg-server", daemon=True)
        self._thread.start()

    def go(self) -> None:
        """The client's send returned and its memory was reused: read what it sent."""
        self._go.set()

    def received(self, timeout_s: float = 10.0) -> bytes:
        """What the client sent (after :meth:`go`); waits for the server to finish."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the hostile server did not finish"
        return bytes(self._got)

    def close(self) -> None:
        self._go.set()
        self._thread.join(10)
        self.listener.close()

    def _serve(self) -> None:
        conn = tls = None
        try:
            conn, _ = self.listener.accept()
            conn.settimeout(self.limit_s)
            head = b""
            while len(head) < 5:
                chunk = conn.recv(5 - len(head))
                if not chunk:
                    raise ConnectionError("the client left before its preamble")
                head += chunk
            assert head == b"AIOTD", head
            conn.sendall(b"G")
            tls = self.context.wrap_socket(conn, server_side=True)
            if self.renegotiate:
                libssl = _libssl()
                for name in ("SSL_renegotiate", "SSL_do_handshake"):
                    function = getattr(libssl, name)
                    function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_int
                pointer = _ssl_pointer(tls)
                tls.setblocking(False)
                assert libssl.SSL_renegotiate(pointer) == 1
                libssl.SSL_do_handshake(pointer)  # sends the HelloRequest; the answer never comes before go()
            self.asked.set()
            self._go.wait(self.limit_s)
            tls.settimeout(0.2)
            deadline = time.monotonic() + self.limit_s
            while time.monotonic() < deadline and len(self._got) < self.expect:
                try:
                    chunk = tls.recv(65536)
                except (ssl.SSLWantReadError, TimeoutError):
                    continue
                if not chunk:
                    break
                self._got += chunk
        except (OSError, ssl.SSLError, AssertionError) as exc:  # a client that refused us ends here
            self.error = exc
        finally:
            self.asked.set()
            for sock in (tls, conn):
                if sock is not None:
                    sock.close()
