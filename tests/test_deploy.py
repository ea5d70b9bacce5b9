"""The cluster recipes (deploy/) are checked as far as this machine can: the Slurm script parses
(``bash -n``) and its dry run prints worker command lines that ``ppotune search``'s own parser
accepts; the Kubernetes manifests pass a strict schema check (kubernetes-validate, which ships
the API schemas) and hang together (names, the secret, the worker command). Neither a Slurm nor a
Kubernetes cluster runs here."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
import yaml

from support import REPO
from trainer.contracts import parse_storage
from tuner.cli import build_parser

SBATCH = REPO / "deploy" / "slurm" / "ppotune_array.sbatch"
K8S = REPO / "deploy" / "k8s"
K8S_VERSION = "1.30.0"


def parse_search(argv: list[str]):
    assert argv[:2] == ["ppotune", "search"], argv
    return build_parser(only="search").parse_args(argv[1:])


# --------------------------------------------------------------------------- Slurm
def test_sbatch_script_parses():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def dry_run(**env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PPOTUNE_", "CUDA_VISIBLE"))}
    return subprocess.run(
        ["bash", str(SBATCH)],
        cwd=REPO,
        env={**clean, "PPOTUNE_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_sbatch_dry_run_prints_one_valid_worker_per_array_task():
    seen = []
    for task in range(3):
        r = dry_run(
            SLURM_ARRAY_TASK_ID=str(task),
            SLURM_GPUS_ON_NODE="8",
            PPOTUNE_NPROC="2",
            PPOTUNE_STORAGE="postgresql://ppotune@db.cluster:5432/ppotune",
            PPOTUNE_EXTRA="--steps 4 --warmup 1",
        )
        assert r.returncode == 0, r.stderr
        (line,) = r.stdout.strip().splitlines()
        args = parse_search(shlex.split(line))
        assert args.parallel == 4 and args.nproc == 2 and args.trials == 64 and args.steps == 4
        assert parse_storage(args.storage).kind == "rdb" and args.study == "tiny_cpu--default"
        seen.append((args.seed, args.out))
    assert len(set(seen)) == 3  # a seed and an output dir of its own per node


def test_sbatch_refuses_a_node_too_small_for_one_trial():
    r = dry_run(SLURM_ARRAY_TASK_ID="0", SLURM_GPUS_ON_NODE="1", PPOTUNE_NPROC="2")
    assert r.returncode == 2 and "nothing fits" in r.stderr


def test_sbatch_through_the_proxy():
    r = dry_run(SLURM_ARRAY_TASK_ID="1", CUDA_VISIBLE_DEVICES="0,1,2,3", PPOTUNE_STORAGE="grpc://proxy:13000")
    args = parse_search(shlex.split(r.stdout))
    assert args.storage == "grpc://proxy:13000" and args.parallel == 4


# --------------------------------------------------------------------------- Kubernetes
def docs() -> dict:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            out[(d["kind"], d["metadata"]["name"])] = d
    return out


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_k8s_manifests_pass_the_api_schema(path):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')"
    )
    for d in yaml.safe_load_all(path.read_text()):
        kv.validate(d, K8S_VERSION, strict=True)


def test_the_schema_check_is_real():
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')"
    )
    job = docs()[("Job", "ppotune-workers")]
    job["spec"]["template"]["spec"]["containers"][0]["comand"] = ["typo"]
    with pytest.raises(kv.ValidationError):
        kv.validate(job, K8S_VERSION, strict=True)


def test_k8s_recipe_hangs_together():
    d = docs()
    job = d[("Job", "ppotune-workers")]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    pod = job["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["command"] == ["/bin/sh", "-c"]
    argv = shlex.split(worker["args"][0].replace('"$JOB_COMPLETION_INDEX"', "0"))
    assert argv[0] == "exec"
    args = parse_search(argv[1:])
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert args.parallel * args.nproc == gpus
    spec = parse_storage(args.storage)
    assert spec.kind == "rdb" and spec.display == spec.url  # no password in the manifest: PGPASSWORD
    host = args.storage.split("@", 1)[1].split(":", 1)[0]
    assert ("Service", host) in d and ("StatefulSet", host) in d
    secret = {e["valueFrom"]["secretKeyRef"]["name"] for e in worker["env"] if e["name"] == "PGPASSWORD"}
    assert secret == {d[("Secret", "ppotune-db")]["metadata"]["name"]}
    proxy = d[("Deployment", "ppotune-proxy")]["spec"]["template"]["spec"]["containers"][0]
    assert proxy["command"][:2] == ["ppotune", "storage-proxy"]
    proxy_args = build_parser(only="storage-proxy").parse_args(proxy["command"][1:])
    assert parse_storage(proxy_args.storage).kind == "rdb"
    assert d[("Service", "ppotune-proxy")]["spec"]["ports"][0]["port"] == proxy_args.port


def _admitted(policy: dict) -> list[dict]:
    """The pod labels a NetworkPolicy's ingress rules admit, one dict per selector, and the ports they open."""
    out = []
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: admits more than pods: {peer}"
            out.append(peer["podSelector"]["matchLabels"])
    return out


def test_the_proxy_admits_only_the_workers():
    """The gRPC proxy has no TLS and no authentication (Optuna's client takes no credentials): its recipe listens
    on every interface of its pod on purpose and lets only the worker pods reach it; the database alike."""
    d = docs()
    worker_labels = d[("Job", "ppotune-workers")]["spec"]["template"]["metadata"]["labels"]
    proxy = d[("Deployment", "ppotune-proxy")]["spec"]["template"]
    proxy_args = build_parser(only="storage-proxy").parse_args(proxy["spec"]["containers"][0]["command"][1:])
    assert proxy_args.host == "0.0.0.0"  # widened explicitly: the default is loopback
    policy = d[("NetworkPolicy", "ppotune-proxy")]
    assert policy["spec"]["podSelector"]["matchLabels"] == proxy["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert _admitted(policy) == [worker_labels]
    ports = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ports == [proxy_args.port]
    db = d[("NetworkPolicy", "ppotune-db")]
    assert (
        db["spec"]["podSelector"]["matchLabels"]
        == d[("StatefulSet", "ppotune-db")]["spec"]["template"]["metadata"]["labels"]
    )
    assert sorted(map(str, _admitted(db))) == sorted(map(str, [worker_labels, proxy["metadata"]["labels"]]))


def test_the_proxy_listens_on_loopback_unless_told():
    args = build_parser(only="storage-proxy").parse_args(["storage-proxy", "--storage", "postgresql://x@h/db"])
    assert args.host == "127.0.0.1"
