"""A slow, lossy cable between two network interfaces, for kernels without tc netem.

Run as root: ``python _cable.py IFACE_A IFACE_B DELAY_MS LOSS STATS_FILE``; and first, in every network
namespace whose traffic crosses it, ``python _cable.py --plain IFACE...`` (see `plain_frames`). Every
Ethernet frame that arrives on one interface leaves by the other DELAY_MS later, unless dropped (each
with probability LOSS), as netem's ``delay D loss L`` does on each side of a link. The interfaces are
the two inner ends of a cut cable (veth ends in the root namespace, on neither of which the kernel
itself sends), read and written through packet sockets. The senders must not hand the kernel frames
larger than the MTU or frames whose checksum the kernel left for the hardware to fill in (veth's
default): a frame sent again through a packet socket keeps the checksum it had.

Every half second, and when SIGTERM ends it, it writes ``{"forwarded": N, "dropped": N}`` to STATS_FILE.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import random
import signal
import socket
import struct
import sys
import threading
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SIOCETHTOOL = 0x8946
# ethtool's "set" commands for TX checksumming, scatter-gather, TCP segmentation and generic segmentation
ETHTOOL_OFFLOADS = (0x17, 0x19, 0x1F, 0x24)


def plain_frames(interfaces: list[str]) -> None:
    """Turn off the offloads of `interfaces` (the ethtool ioctl: Debian's ethtool is not needed), so that
    each frame they send is whole: at most the MTU long, its checksums computed."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in interfaces:
            for cmd in ETHTOOL_OFFLOADS:
                value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))  # struct ethtool_value
                request = struct.pack("16sP", name.encode(), ctypes.addressof(value))  # struct ifreq
                fcntl.ioctl(s.fileno(), SIOCETHTOOL, request)


class Direction:
    """Frames from one interface to the other: a reader that stamps and drops, a writer that waits."""

    def __init__(self, source: socket.socket, sink: socket.socket, delay: float, loss: float) -> None:
        self.source, self.sink, self.delay, self.loss = source, sink, delay, loss
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.forwarded = self.dropped = 0
        self.random = random.Random()

    def read(self) -> None:
        while True:
            frame, address = self.source.recvfrom(1 << 16)
            if address[2] == PACKET_OUTGOING:
                continue
            if self.random.random() < self.loss:
                self.dropped += 1
                continue
            with self.ready:
                self.queue.append((time.monotonic() + self.delay, frame))
                self.ready.notify()

    def write(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                due, frame = self.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                self.sink.send(frame)
                self.forwarded += 1
            except OSError:  # the far side is down (a test cut it): the frame is lost, as on a wire
                self.dropped += 1


def main() -> None:
    if sys.argv[1] == "--plain":
        plain_frames(sys.argv[2:])
        return
    a, b, delay_ms, loss, stats = (
        sys.argv[1],
        sys.argv[2],
        float(sys.argv[3]),
        float(sys.argv[4]),
        sys.argv[5],
    )
    ends = []
    for name in (a, b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((name, 0))
        ends.append(s)
    directions = [
        Direction(ends[0], ends[1], delay_ms / 1e3, loss),
        Direction(ends[1], ends[0], delay_ms / 1e3, loss),
    ]
    for d in directions:
        threading.Thread(target=d.read, daemon=True).start()
        threading.Thread(target=d.write, daemon=True).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print("ready", flush=True)
    while not done.wait(0.5):
        _write_counts(stats, directions)
    _write_counts(stats, directions)


def _write_counts(path: str, directions: list[Direction]) -> None:
    counts = {
        "forwarded": sum(d.forwarded for d in directions),
        "dropped": sum(d.dropped for d in directions),
    }
    with open(path + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
