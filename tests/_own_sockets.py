"""This process's TCP sockets as /proc lists them, for tests and child programs that check what a close or an
exit left open; and the facade options the exit children share."""

import os
from collections.abc import Iterator


def own_tcp() -> Iterator[tuple[int, str]]:
    """(local port, state) of each of this process's TCP sockets (IPv4 and IPv6; state ``0A`` is LISTEN),
    found in /proc/net/tcp and tcp6 by the inodes of this process's fds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                lines = rows.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                yield int(fields[1].rsplit(":", 1)[1], 16), fields[3]


def listening_ports() -> list[int]:
    """The TCP ports this process listens on."""
    return sorted(port for port, state in own_tcp() if state == "0A")


def facade_options() -> dict[str, str]:
    """Options of a blocking-facade endpoint listening on a free loopback port over TCP."""
    from aio_datadist.compat import LLMConfig

    config = LLMConfig()
    config.device_id = 0
    config.transport = "tcp"
    config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()
