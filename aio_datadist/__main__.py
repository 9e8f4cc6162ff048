"""Command line: ``python -m aio_datadist demo`` and ``python -m aio_datadist bench``.

``bench`` runs the transfer benchmark of the source checkout
(``benchmarks/transfer.py``: ``pull_blocks`` and ``push_blocks`` between two
processes against a raw-socket baseline of the same run) over each transport
that can run here (``--transport all``, the default: ``tcp``, ``local`` and,
where the NIXL package imports, ``nixl``), and names in every row the
transport each link negotiated. The ``benchmarks`` package ships with the
source, not with the installed package, so ``bench`` runs from the root of a
checkout. A progress bar needs ``tqdm`` and ``--plot`` needs ``matplotlib``
(both in the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH_EXTRA = 'pip install -e ".[bench]"'
METRICS_EXTRA = "pip install 'aio_datadist[metrics]'"
#: The most aio.DataChannels takes (config.py).
MAX_DATA_CHANNELS = 16


def _block_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected block counts >= 1, got {text!r}")
    return counts


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _data_channels(text: str) -> int:
    value = _positive(text)
    if value > MAX_DATA_CHANNELS:
        raise argparse.ArgumentTypeError(f"expected an integer in 1..{MAX_DATA_CHANNELS} (aio.DataChannels), "
                                         f"got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aio_datadist",
                                     description="asyncio-native KV-cache transfer (LLM-DataDist API)")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a PROMPT and a DECODER process on loopback moving a real KV cache")
    demo.add_argument("--transport", choices=("auto", "tcp", "local", "nixl"), default="auto",
                      help="aio.Transport of both endpoints (default auto: same-host sharing here; "
                           "nixl needs the nixl extra)")
    demo.set_defaults(subparser=demo)
    demo.add_argument("--metrics-port", type=_port, metavar="N",
                      help="export both endpoints' Prometheus metrics on 127.0.0.1 (the decoder on N, the prompt "
                           "on a free port; 0: any free port) and print a scrape of both (needs the metrics extra)")
    bench = sub.add_parser(
        "bench", help="benchmark pull_blocks/push_blocks between two processes (from a source checkout)",
        description="Time pull_blocks and push_blocks between two processes on loopback, over each transport "
                    "asked, against a raw TCP socket moving the same bytes in the same run, and print the table "
                    "of ratios; each row names the transport its link negotiated. Runs the benchmarks/ programs "
                    "of a source checkout: start it from the repository root.")
    bench.add_argument("--quick", action="store_true", help="few repeats (seconds per size and transport)")
    bench.add_argument("--sizes", type=_block_counts, metavar="N[,N...]",
                       help="blocks per request (one block is 2 MiB over the 64 tensors); "
                            "default: the benchmark's (64,4)")
    bench.add_argument("--transport", choices=("tcp", "local", "nixl", "all"), default="all",
                       help="aio.Transport of both endpoints: tcp (data channels), local (same-host shared "
                            "memory), nixl, or all (default: each of them that can run here; nixl only where "
                            "the NIXL package imports, else the table says why it has no nixl rows). Rows name "
                            "the transport each link negotiated")
    bench.add_argument("--uvloop", action="store_true", help="both processes run their event loop on uvloop")
    bench.add_argument("--data-channels", type=_data_channels, metavar="N",
                       help=f"aio.DataChannels, 1..{MAX_DATA_CHANNELS} (default: the library's)")
    bench.add_argument("--format", choices=("text", "markdown", "json"), default="text", help="table format")
    bench.add_argument("--plot", type=Path, metavar="OUT.png",
                       help=f"also write a plot of throughput against request size (needs matplotlib: {BENCH_EXTRA})")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines on stderr")
    bench.set_defaults(subparser=bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            if args.metrics_port is not None:  # refuse before two processes start torch, not in their tracebacks
                _check_metrics_port(args.subparser, args.metrics_port)
            if args.transport == "nixl" and (why := _nixl_missing()):
                print(f"python -m aio_datadist demo: error: --transport nixl: {why}", file=sys.stderr)
                return 1
            from aio_datadist.demo import main as demo

            with _sigterm_interrupts():
                return demo(args.transport, args.metrics_port)
        if args.command == "bench":
            return _bench(args.subparser, args)
    except _Terminated:  # kill PID: as Ctrl-C, the finally blocks reaped the children
        print(f"{args.command} terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback per process (the finally blocks reaped them)
        if threading.current_thread() is threading.main_thread():  # Ctrl-C again: no traceback as the process exits
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"{args.command} interrupted", file=sys.stderr)
        return 130
    return 2


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the demo's ``finally`` reaps its processes."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` inside the block (main thread only); once, then it is ignored until
    the block ends, so that a second one cannot cut the reaping short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _nixl_missing() -> str:
    """Why aio.Transport=nixl cannot start here ("" when it can): said before the demo spawns processes."""
    from aio_datadist.status import LLMException
    from aio_datadist.transport.nixl_engine import load_nixl

    try:
        load_nixl()
    except LLMException as exc:  # names what to install
        return str(exc.args[0])
    except Exception as exc:  # a broken install's own error
        return f"the NIXL package does not import here ({type(exc).__name__}: {exc})"
    return ""


def _check_metrics_port(parser: argparse.ArgumentParser, port: int) -> None:
    try:
        import prometheus_client  # noqa: F401 -- what the demo's processes will import
    except ImportError as exc:
        parser.error(f"--metrics-port needs prometheus_client, which does not import here ({exc}): {METRICS_EXTRA}")
    if port:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the exporter's server binds
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                parser.error(f"--metrics-port {port}: cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}")


# -- bench ------------------------------------------------------------------------------


def _import_transfer_benchmark() -> Any:
    """``benchmarks/transfer.py`` of the checkout this ``aio_datadist`` was imported from, run from its root.

    Found by path, not by whatever ``benchmarks`` comes first on ``sys.path``: the current folder may be a
    project with a ``benchmarks/`` of its own (asv, pytest-benchmark), whose modules must not run here.
    """
    import aio_datadist

    root = Path(aio_datadist.__file__).resolve().parent.parent
    program = root / "benchmarks" / "transfer.py"
    loaded = sys.modules.get("benchmarks.transfer")
    if loaded is not None and Path(loaded.__file__ or "").resolve() == program:  # imported by the caller
        return loaded
    if not program.is_file() or Path.cwd().resolve() != root:
        there = f"\n(this aio_datadist comes from the checkout at {root}: run it there)"
        elsewhere = there if program.is_file() else ""
        raise SystemExit(
            "python -m aio_datadist bench: cannot import the benchmark programs (benchmarks/transfer.py).\n"
            "They come with the source checkout, not with the installed package: run this command from the\n"
            "root of an aio_datadist checkout (the folder that holds benchmarks/), for example\n"
            f"    cd path/to/aio_datadist && python -m aio_datadist bench --quick{elsewhere}")
    package = sys.modules.get("benchmarks")
    if package is not None and str(root / "benchmarks") not in [str(Path(p).resolve()) for p in
                                                                 getattr(package, "__path__", ())]:
        raise SystemExit(f"python -m aio_datadist bench: another package named benchmarks is imported already "
                         f"({getattr(package, '__file__', None) or list(getattr(package, '__path__', ()))}), "
                         f"not the one at {program.parent}")
    if sys.path[:1] != [str(root)]:
        sys.path.insert(0, str(root))
    transfer = importlib.import_module("benchmarks.transfer")
    if Path(transfer.__file__ or "").resolve() != program:
        raise SystemExit(f"python -m aio_datadist bench: another package named benchmarks is imported already "
                         f"({transfer.__file__}), not the one at {program.parent}")
    return transfer


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.plot is not None:  # refuse before minutes of measuring, not after
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
        except ImportError:
            parser.error(f"--plot needs matplotlib, which is not installed: {BENCH_EXTRA}")
        formats = FigureCanvasAgg.get_supported_filetypes()
        if args.plot.suffix.lstrip(".").lower() not in formats:
            parser.error(f"--plot: name the file with one of the suffixes {', '.join(sorted(formats))}")
        if not args.plot.parent.is_dir():
            parser.error(f"--plot: folder {str(args.plot.parent)!r} does not exist")
        if args.plot.is_dir():
            parser.error(f"--plot: {str(args.plot)!r} is a folder, not a file")
    if args.uvloop and importlib.util.find_spec("uvloop") is None:
        parser.error("--uvloop needs uvloop, which is not installed (pip install uvloop)")
    transfer = _import_transfer_benchmark()
    transports, absent = transfer.transports_for(args.transport)
    if not transports:
        parser.error(f"--transport {args.transport}: {absent[args.transport]}")
    from benchmarks._cli import emit, fits_in_memory
    from benchmarks.harness import KvGeometry, Table, machine_info, run_coroutine

    geometry = KvGeometry()
    counts = tuple(args.sizes or transfer.SIZES)
    table = Table(transfer.title(args.quick, args.uvloop, transports), machine=machine_info())
    for transport, why in absent.items():
        print(f"no {transport} rows: {why}", file=sys.stderr)
    if not fits_in_memory(table, "transfer", max(counts), transfer._footprint(geometry, counts, len(transports))):
        emit(table, args.format)
        return 1
    with _Progress(counts, enabled=not args.no_progress) as progress:
        measured = run_coroutine(
            lambda: transfer._measure(geometry, counts, args.quick, args.data_channels, args.uvloop, progress,
                                      transports),
            use_uvloop=args.uvloop)
    transfer.fill_table(table, measured, geometry, counts, quick=args.quick, use_uvloop=args.uvloop, absent=absent)
    emit(table, args.format)
    if args.plot is not None:
        _plot(args.plot, measured, geometry, counts, table.title)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _plot(path: Path, measured: Any, geometry: Any, counts: Sequence[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    from benchmarks.transfer import RAW

    sizes = sorted(set(counts))
    mib = [geometry.request_bytes(c) / 2**20 for c in sizes]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = [(RAW, "raw TCP socket sendall/recv_into (baseline)", "k--")]
    for colour, asked in enumerate(measured.negotiated):
        lines += [(measured.name(op, asked), measured.name(op, asked), f"C{colour}{style}")
                  for op, style in (("pull_blocks", "-"), ("push_blocks", ":"))]
    for name, label, style in lines:
        ax.plot(mib, [measured.samples[name, c].gbps for c in sizes], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(mib, [f"{m:g}" for m in mib])
    ax.set_xlabel(f"request size (MiB over {geometry.num_tensors} tensors)")
    ax.set_ylabel("throughput (GB/s, median sample)")
    ax.set_ylim(bottom=0)
    ax.set_title(title.replace(" (", "\n(", 1), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _Progress:
    """The progress callable ``benchmarks.transfer`` reports to: a tqdm bar, or lines on stderr.

    The benchmark calls it after linking and after each request size.
    """

    def __init__(self, counts: Sequence[int], enabled: bool) -> None:
        self._steps = ["start the peer process and link", *(f"measure {c} blocks" for c in counts)]
        self._done = 0
        self._start = time.perf_counter()
        self._bar = None
        self._enabled = enabled
        if enabled and sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=len(self._steps), desc=self._steps[0], unit="step", file=sys.stderr,
                             bar_format="{desc}: {bar} {n_fmt}/{total_fmt} [{elapsed}]")
        elif enabled:
            self._line(self._steps[0])

    def _line(self, what: str) -> None:
        print(f"[{time.perf_counter() - self._start:6.1f}s] {what}...", file=sys.stderr, flush=True)

    def __call__(self, what: str) -> None:
        self._done += 1
        upcoming = self._steps[self._done] if self._done < len(self._steps) else "done"
        if self._bar is not None:
            self._bar.set_description_str(upcoming, refresh=False)
            self._bar.update(1)
        elif self._enabled and self._done < len(self._steps):
            self._line(upcoming)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()


if __name__ == "__main__":
    sys.exit(main())
