"""Optuna's gRPC storage proxy in front of a database (``ppotune storage-proxy``: :mod:`tuner.commands.storage_proxy`).

Hundreds of workers on one database each hold a connection pool; behind the proxy they hold one
gRPC channel each and the proxy holds the pool (Optuna's ``run_grpc_proxy_server``, over the
cached RDB storage as Optuna recommends). Workers, ``report`` and ``export`` then use
``--storage grpc://HOST:P``. The proxy creates Optuna's tables if the database is empty.

What the proxy does not give: a cross-process lock (workers on it keep ``--trials`` exact by
checking their trial's rank after ``ask()``: :func:`tuner.rules.budget.over_budget`) and Optuna's
database heartbeat (workers' own heartbeats still go through it as trial attributes).

Nor any security: Optuna's gRPC proxy speaks plaintext with no authentication, and its client
(``optuna.storages.GrpcStorageProxy(host, port)``, Optuna 5.0) takes no credentials, so neither TLS nor a
token can be added on our side without reaching into Optuna's private channel code. Whoever reaches the port
reads the study (configs, paths, host names) and writes to it. So the proxy listens on 127.0.0.1 unless
``--host`` widens it, and then says that the study is open to that network; on a cluster, admit only the
workers (deploy/k8s/proxy.yaml's NetworkPolicy; docs/security.md).
"""

from __future__ import annotations

__all__ = ["LOOPBACK", "exposure_warning"]

LOOPBACK = "127.0.0.1"


def exposure_warning(host: str, port: int) -> str | None:
    """What to say when ``host`` is not a loopback address: the study is open to that network (None: loopback)."""
    import ipaddress

    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it resolves to something other than this host only, as far as we know
    where = "every network this host is on" if host in ("0.0.0.0", "::") else f"the network of {host}"
    return (
        f"the study is open to {where} on port {port}: Optuna's gRPC proxy has no TLS and no authentication (its "
        "client takes no credentials), so whoever reaches the port reads the study and writes to it; admit only the "
        "workers (a firewall, or deploy/k8s/proxy.yaml's NetworkPolicy; docs/security.md)"
    )
