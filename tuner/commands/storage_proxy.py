"""``ppotune storage-proxy --storage URL --port P``: serve a study database through Optuna's gRPC proxy
(what it gives and what it does not: :mod:`tuner.study.proxy`). SIGTERM ends it like Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

from trainer.contracts import ExitCode, StorageError, parse_storage
from tuner.study.proxy import LOOPBACK, exposure_warning
from tuner.study.storage import close_storage, open_storage

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage", required=True, help="the database behind the proxy (postgresql://..., mysql://...)")
    p.add_argument("--port", type=int, default=13000, help="port to serve on (default 13000, Optuna's)")
    p.add_argument(
        "--host",
        default=LOOPBACK,
        help=f"address to listen on (default {LOOPBACK}: this host only; 0.0.0.0: every interface, and the study is "
        "open to whoever reaches the port: no TLS, no authentication)",
    )
    p.add_argument("--threads", type=int, default=16, help="gRPC worker threads (default 16)")


def _port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served (gRPC only logs a bind failure once it is serving), or None."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def run(args: argparse.Namespace) -> int:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        spec = parse_storage(args.storage)
        if spec.kind != "rdb":
            raise StorageError(
                f"--storage {spec.display}: the proxy serves a database server (postgresql://, mysql://); "
                "a SQLite file or journal is read directly, a grpc:// URL is already a proxy"
            )
        if not 0 < args.port < 65536 or args.threads < 1:
            raise StorageError("--port must be in 1..65535 and --threads >= 1")
        storage = open_storage(spec)
    except StorageError as e:
        print(f"ppotune storage-proxy: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    taken = _port_taken(args.host, args.port)
    if taken:
        close_storage(storage)
        print(f"ppotune storage-proxy: error: cannot serve on {args.host}:{args.port}: {taken}", file=sys.stderr)
        return ExitCode.ERROR

    # SIGTERM (Slurm, Kubernetes) ends the proxy like Ctrl-C: connections closed, exit code said
    stopping = threading.Event()

    def on_signal(signum, _frame):
        stopping.set()
        raise KeyboardInterrupt

    warning = exposure_warning(args.host, args.port)
    old = signal.signal(signal.SIGTERM, on_signal)
    try:  # from here on a SIGTERM lands in the except below, even one sent right after "serving" is read
        print(f"ppotune storage-proxy: serving {spec.display} on grpc://{args.host}:{args.port}", flush=True)
        if warning:
            print(f"ppotune storage-proxy: warning: {warning}", file=sys.stderr, flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.run_grpc_proxy_server(
                storage, host=args.host, port=args.port, thread_pool=ThreadPoolExecutor(max_workers=args.threads)
            )
    except KeyboardInterrupt:
        print("ppotune storage-proxy: stopped", flush=True)
        return 143 if stopping.is_set() else ExitCode.INTERRUPTED
    except RuntimeError as e:  # the port is taken
        print(f"ppotune storage-proxy: error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return ExitCode.ERROR
    finally:
        signal.signal(signal.SIGTERM, old)
        close_storage(storage)
    return ExitCode.OK
