"""Static checks of the infrastructure as code under infra/ (no cloud account, no terraform).

- every .tf file parses (python-hcl2); modules exist, and each call passes exactly what the
  module declares; every var./local./module. reference resolves; required variables and
  outputs exist and are documented;
- storage: SSE-KMS, public access blocked, versioning, lifecycle for temporary and partial
  data, TLS-only bucket policy;
- identity: the IRSA policy, evaluated on concrete requests, allows reads on prompts/,
  reads and writes on outputs/ and nothing else; the trust policy names one service account;
- Kubernetes: every YAML parses; the RayJob templates, rendered the way templatefile() and the
  scheduler render them, carry what KubeRay needs; the scheduler script, run against a fake
  kubectl, creates the generation RayJob on the dated prefix, then the report RayJob;
- the Dockerfile; the example job config validates against the pipeline's own schema;
- checkov over infra/ reports no failed check, and every skip is justified in place.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

import hcl2  # noqa: E402  (python-hcl2, from the test extra)

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
TF = INFRA / "terraform"
MODULES = TF / "modules"
EXAMPLE = TF / "envs" / "example"
WORKFLOW_TEMPLATES = MODULES / "workflows" / "templates"

META_ARGS = {"source", "version", "count", "for_each", "providers", "depends_on"}


# --- HCL helpers -------------------------------------------------------------------------------


def _clean(value):
    """python-hcl2 >= 7 keeps the quotes of string literals and labels and adds
    __is_block__ / __comments__ markers; drop both so values read like the source."""
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items() if k not in ("__is_block__", "__comments__")}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _load(path: Path) -> dict:
    with path.open() as f:
        return _clean(hcl2.load(f))


def _blocks(doc: dict, kind: str) -> dict:
    """{label: body} of top-level blocks of one kind (variable, output, module, locals...)."""
    out = {}
    for entry in doc.get(kind, []):
        out.update(entry)
    return out


def _nested(doc: dict, kind: str) -> dict:
    """{(type, name): body} of resource / data blocks."""
    out = {}
    for entry in doc.get(kind, []):
        for rtype, named in entry.items():
            for name, body in named.items():
                out[(rtype, name)] = body
    return out


class TfDir:
    def __init__(self, path: Path):
        self.path = path
        self.files = sorted(path.glob("*.tf"))
        self.docs = {f: _load(f) for f in self.files}
        self.text = "\n".join(f.read_text() for f in self.files)

    def merged(self, kind: str) -> dict:
        out = {}
        for doc in self.docs.values():
            out.update(_blocks(doc, kind))
        return out

    def nested(self, kind: str) -> dict:
        out = {}
        for doc in self.docs.values():
            out.update(_nested(doc, kind))
        return out

    @property
    def variables(self) -> dict:
        return self.merged("variable")

    @property
    def outputs(self) -> dict:
        return self.merged("output")

    @property
    def modules(self) -> dict:
        return self.merged("module")

    @property
    def locals(self) -> dict:
        out = {}
        for doc in self.docs.values():
            for entry in doc.get("locals", []):
                out.update(entry)
        return out


def _tf_dirs() -> list[Path]:
    return sorted({p.parent for p in TF.rglob("*.tf") if ".terraform" not in p.parts})


@pytest.fixture(scope="module")
def tfdirs() -> dict[Path, TfDir]:
    return {d: TfDir(d) for d in _tf_dirs()}


# --- Parsing and wiring --------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(TF.rglob("*.tf")), ids=lambda p: str(p.relative_to(TF)))
def test_every_tf_file_parses(path):
    doc = _load(path)
    assert isinstance(doc, dict)


def test_expected_layout():
    for name in ("storage", "identity", "cluster", "kuberay", "workflows"):
        assert (MODULES / name / "main.tf").is_file(), name
        assert (MODULES / name / "variables.tf").is_file(), name
        assert (MODULES / name / "outputs.tf").is_file(), name
    assert (EXAMPLE / "main.tf").is_file()
    assert (INFRA / "docker" / "Dockerfile").is_file()


def test_every_module_source_exists_and_gets_what_it_declares(tfdirs):
    calls = 0
    for d, tf in tfdirs.items():
        for name, call in tf.modules.items():
            calls += 1
            source = call["source"]
            assert source.startswith(("./", "../")), f"{d}: module {name} must use a local source, got {source}"
            target = (d / source).resolve()
            assert target.is_dir() and list(target.glob("*.tf")), f"{d}: module {name}: {source} does not exist"
            declared = TfDir(target).variables
            passed = set(call) - META_ARGS
            unknown = passed - set(declared)
            assert not unknown, f"{d}: module {name} passes undeclared variables {sorted(unknown)}"
            required = {v for v, body in declared.items() if "default" not in body}
            missing = required - passed
            assert not missing, f"{d}: module {name} misses required variables {sorted(missing)}"
    assert calls >= 5


def test_every_reference_resolves(tfdirs):
    for d, tf in tfdirs.items():
        for ref in set(re.findall(r"\bvar\.([A-Za-z_][\w-]*)", tf.text)):
            assert ref in tf.variables, f"{d}: var.{ref} is not declared"
        for ref in set(re.findall(r"\blocal\.([A-Za-z_][\w-]*)", tf.text)):
            assert ref in tf.locals, f"{d}: local.{ref} is not defined"
        for mod, out in set(re.findall(r"\bmodule\.([A-Za-z_][\w-]*)\.([A-Za-z_][\w-]*)", tf.text)):
            assert mod in tf.modules, f"{d}: module.{mod} is not called"
            target = TfDir((d / tf.modules[mod]["source"]).resolve())
            assert out in target.outputs, f"{d}: module.{mod}.{out} is not an output of {target.path.name}"
        for rtype, name in set(re.findall(r"(?<![\w.])(aws_[a-z0-9_]+|kubernetes_[a-z0-9_]+|helm_[a-z_]+)\.([a-z_][\w-]*)\b", tf.text)):
            if name in ("arn", "id", "name", "json"):
                continue
            resources = {k for k in tf.nested("resource")}
            assert (rtype, name) in resources, f"{d}: {rtype}.{name} is not a resource of this directory"
        for rtype, name in set(re.findall(r"\bdata\.([a-z0-9_]+)\.([a-z_][\w-]*)", tf.text)):
            assert (rtype, name) in tf.nested("data"), f"{d}: data.{rtype}.{name} is not declared"


def test_variables_and_outputs_are_documented(tfdirs):
    for d, tf in tfdirs.items():
        for name, body in tf.variables.items():
            assert body.get("description", "").strip(), f"{d}: variable {name} has no description"
            assert "type" in body, f"{d}: variable {name} has no type"
        for name, body in tf.outputs.items():
            assert body.get("description", "").strip(), f"{d}: output {name} has no description"


REQUIRED = {
    "modules/storage": (
        {"bucket_name", "access_log_bucket", "prompts_prefix", "outputs_prefix", "temporary_prefixes",
         "temporary_expiration_days", "abort_incomplete_upload_days"},
        {"bucket_name", "bucket_arn", "kms_key_arn", "prompts_uri", "outputs_uri"},
    ),
    "modules/identity": (
        {"name", "oidc_provider_arn", "oidc_issuer", "namespace", "service_account", "bucket_arn",
         "kms_key_arn", "prompts_prefix", "outputs_prefix"},
        {"role_arn"},
    ),
    "modules/cluster": (
        {"create_cluster", "cluster_name", "subnet_ids", "gpu_instance_types", "gpu_capacity_type",
         "gpu_min_nodes", "gpu_max_nodes"},
        {"cluster_name", "cluster_endpoint", "cluster_ca_certificate", "oidc_provider_arn", "oidc_issuer",
         "gpu_node_selector"},
    ),
    "modules/kuberay": ({"kuberay_version", "install_nvidia_device_plugin"}, {"operator_namespace"}),
    "modules/workflows": (
        {"namespace", "image", "ray_version", "service_account", "ray_role_arn", "bucket_name",
         "outputs_prefix", "workflows", "gpu_node_selector"},
        {"namespace", "cron_jobs", "output_uri_templates", "rayjob_manifests"},
    ),
    "envs/example": (
        {"region", "bucket_name", "access_log_bucket", "create_cluster", "cluster_name", "subnet_ids",
         "gpu_instance_types", "gpu_capacity_type", "gpu_min_nodes", "gpu_max_nodes", "image", "dataset",
         "schedule", "replicas", "tensor_parallel_size"},
        {"bucket_name", "cluster_name", "kubeconfig_command", "ray_role_arn", "namespace", "cron_jobs",
         "output_uri_templates", "rayjob_manifests"},
    ),
}


@pytest.mark.parametrize("rel", sorted(REQUIRED))
def test_required_variables_and_outputs(rel, tfdirs):
    tf = tfdirs[TF / rel]
    variables, outputs = REQUIRED[rel]
    assert variables <= set(tf.variables), sorted(variables - set(tf.variables))
    assert outputs <= set(tf.outputs), sorted(outputs - set(tf.outputs))


def test_cluster_choices_are_variables(tfdirs):
    cluster = tfdirs[MODULES / "cluster"]
    gpu = cluster.nested("resource")[("aws_eks_node_group", "gpu")]
    assert gpu["capacity_type"] == "${var.gpu_capacity_type}"
    assert gpu["instance_types"] == "${var.gpu_instance_types}"
    scaling = gpu["scaling_config"][0]
    assert scaling["min_size"] == "${var.gpu_min_nodes}" and scaling["max_size"] == "${var.gpu_max_nodes}"
    assert "NVIDIA" in gpu["ami_type"]
    assert gpu["taint"][0]["key"] == "nvidia.com/gpu"
    # An existing cluster instead of a new one.
    assert cluster.variables["create_cluster"]["type"] == "bool"
    assert ("aws_eks_cluster", "existing") in cluster.nested("data")
    kuberay = tfdirs[MODULES / "kuberay"].nested("resource")[("helm_release", "kuberay_operator")]
    assert kuberay["chart"] == "kuberay-operator" and kuberay["version"] == "${var.kuberay_version}"


# --- Storage -----------------------------------------------------------------------------------


def test_bucket_is_encrypted_private_versioned_and_tls_only(tfdirs):
    res = tfdirs[MODULES / "storage"].nested("resource")
    data = tfdirs[MODULES / "storage"].nested("data")

    sse = res[("aws_s3_bucket_server_side_encryption_configuration", "this")]["rule"][0]
    default = sse["apply_server_side_encryption_by_default"][0]
    assert default["sse_algorithm"] == "aws:kms" and "aws_kms_key.bucket" in default["kms_master_key_id"]
    assert res[("aws_kms_key", "bucket")]["enable_key_rotation"] is True

    pab = res[("aws_s3_bucket_public_access_block", "this")]
    for flag in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"):
        assert pab[flag] is True, flag

    versioning = res[("aws_s3_bucket_versioning", "this")]["versioning_configuration"][0]
    assert versioning["status"] == "Enabled"

    lifecycle = res[("aws_s3_bucket_lifecycle_configuration", "this")]
    partial = lifecycle["rule"][0]
    assert partial["status"] == "Enabled"
    assert "abort_incomplete_multipart_upload" in partial and "noncurrent_version_expiration" in partial
    temporary = lifecycle["dynamic"][0]["rule"]
    assert temporary["for_each"] == "${toset(var.temporary_prefixes)}"
    assert temporary["content"][0]["filter"][0]["prefix"] == "${rule.value}"
    assert temporary["content"][0]["expiration"][0]["days"] == "${var.temporary_expiration_days}"

    tls = data[("aws_iam_policy_document", "tls_only")]["statement"]
    secure = [s for s in tls if s["condition"][0]["variable"] == "aws:SecureTransport"]
    assert secure and secure[0]["effect"] == "Deny" and secure[0]["condition"][0]["values"] == ["false"]
    assert secure[0]["principals"][0]["identifiers"] == ["*"]
    policy = res[("aws_s3_bucket_policy", "tls_only")]
    assert policy["policy"] == "${data.aws_iam_policy_document.tls_only.json}"


# --- Identity: least privilege, evaluated --------------------------------------------------------

SAMPLE = {
    "bucket_arn": "arn:aws:s3:::acme-data",
    "kms_key_arn": "arn:aws:kms:us-east-1:123456789012:key/1111-2222",
    "prompts_prefix": "prompts/",
    "outputs_prefix": "outputs/",
    "region": "us-east-1",
    "namespace": "specbatch",
    "service_account": "specbatch-ray",
    "oidc_issuer": "oidc.eks.us-east-1.amazonaws.com/id/ABC",
    "oidc_provider_arn": "arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/ABC",
}


def _subst(value):
    if isinstance(value, list):
        return [_subst(v) for v in value]
    out = re.sub(r"\$\{var\.(\w+)\}", lambda m: SAMPLE[m.group(1)], value)
    assert "${" not in out, f"cannot evaluate {value!r}"
    return out


def _policy(name: str) -> list[dict]:
    doc = TfDir(MODULES / "identity").nested("data")[("aws_iam_policy_document", name)]
    statements = []
    for s in doc["statement"]:
        assert set(s) <= {"sid", "effect", "actions", "resources", "condition", "principals"}, s
        statements.append({
            "effect": s["effect"],
            "actions": _subst(s["actions"]),
            "resources": _subst(s.get("resources", [])),
            "conditions": [(c["test"], c["variable"] if "${" not in c["variable"] else _subst(c["variable"]),
                            _subst(c["values"])) for c in s.get("condition", [])],
            "principals": s.get("principals", []),
        })
    return statements


def _allowed(statements, action: str, resource: str, context: dict | None = None) -> bool:
    context = context or {}

    def condition_holds(test, key, values):
        if key not in context:
            return False
        if test == "StringEquals":
            return context[key] in values
        if test == "StringLike":
            return any(fnmatch.fnmatchcase(context[key], v) for v in values)
        raise AssertionError(f"unexpected condition operator {test}")

    for s in statements:
        if s["effect"] != "Allow":
            continue
        if not any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in s["actions"]):
            continue
        if not any(fnmatch.fnmatchcase(resource, r) for r in s["resources"]):
            continue
        if all(condition_holds(*c) for c in s["conditions"]):
            return True
    return False


def test_ray_role_policy_has_no_wildcard_action_or_resource():
    statements = _policy("data_access")
    allowed_actions = {
        "s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
        "s3:ListMultipartUploadParts", "kms:Decrypt", "kms:GenerateDataKey",
    }
    bucket = SAMPLE["bucket_arn"]
    for s in statements:
        assert s["effect"] == "Allow"
        for action in s["actions"]:
            assert "*" not in action and action in allowed_actions, action
        for resource in s["resources"]:
            assert resource != "*" and resource not in (f"{bucket}/*", f"{bucket}*"), resource
            assert resource.startswith(bucket) or resource == SAMPLE["kms_key_arn"], resource
            if "*" in resource:  # only "every key under one prefix"
                assert resource in (f"{bucket}/prompts/*", f"{bucket}/outputs/*"), resource


def test_ray_role_reads_prompts_and_reads_writes_outputs_only():
    p = _policy("data_access")
    b = SAMPLE["bucket_arn"]
    prompt, output = f"{b}/prompts/ds/part-0.parquet", f"{b}/outputs/ds/2026-11-29/outputs/part-0.parquet"

    assert _allowed(p, "s3:GetObject", prompt)
    for write in ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert not _allowed(p, write, prompt), write

    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert _allowed(p, action, output), action

    assert _allowed(p, "s3:ListBucket", b, {"s3:prefix": "prompts/ds/"})
    assert _allowed(p, "s3:ListBucket", b, {"s3:prefix": "outputs/ds/2026-11-29/"})
    assert not _allowed(p, "s3:ListBucket", b, {"s3:prefix": "secrets/"})
    assert not _allowed(p, "s3:ListBucket", b)  # the whole bucket

    for action, resource in [
        ("s3:GetObject", f"{b}/other/x"),
        ("s3:GetObject", "arn:aws:s3:::another-bucket/prompts/x"),
        ("s3:PutObject", f"{b}/tmp/x"),
        ("s3:DeleteObjectVersion", output),  # history of versioned outputs stays
        ("s3:PutObjectAcl", output),
        ("s3:DeleteBucket", b),
        ("s3:PutBucketPolicy", b),
        ("s3:PutLifecycleConfiguration", b),
        ("iam:PassRole", "arn:aws:iam::123456789012:role/x"),
        ("kms:Decrypt", "arn:aws:kms:us-east-1:123456789012:key/other"),
    ]:
        assert not _allowed(p, action, resource, {"s3:prefix": "prompts/"}), (action, resource)

    # The bucket key only through S3 in the bucket's region.
    key = SAMPLE["kms_key_arn"]
    assert _allowed(p, "kms:Decrypt", key, {"kms:ViaService": "s3.us-east-1.amazonaws.com"})
    assert _allowed(p, "kms:GenerateDataKey", key, {"kms:ViaService": "s3.us-east-1.amazonaws.com"})
    assert not _allowed(p, "kms:Decrypt", key)
    assert not _allowed(p, "kms:Encrypt", key, {"kms:ViaService": "s3.us-east-1.amazonaws.com"})


def test_ray_role_is_assumable_only_by_the_ray_service_account():
    (trust,) = _policy("trust")
    assert trust["actions"] == ["sts:AssumeRoleWithWebIdentity"]
    assert trust["principals"][0]["type"] == "Federated"
    conditions = {(t, k): v for t, k, v in trust["conditions"]}
    issuer = SAMPLE["oidc_issuer"]
    assert conditions[("StringEquals", f"{issuer}:sub")] == ["system:serviceaccount:specbatch:specbatch-ray"]
    assert conditions[("StringEquals", f"{issuer}:aud")] == ["sts.amazonaws.com"]


# --- Kubernetes manifests ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.yaml")) + sorted(INFRA.rglob("*.yml")),
                         ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs


def _template_var_names() -> set[str]:
    text = (MODULES / "workflows" / "main.tf").read_text()
    block = text.split("template_vars = {", 1)[1].split("\n  rayjobs = {", 1)[0]
    return set(re.findall(r"^\s{6}(\w+)\s+=", block, flags=re.M))


def _render_tf_template(path: Path, values: dict) -> str:
    """templatefile() for templates that only use plain ${name} interpolations."""
    text = path.read_text()
    assert "%{" not in text and "$${" not in text, f"{path.name}: keep templates to plain ${{name}}"
    names = set(re.findall(r"\$\{([^}]*)\}", text))
    assert all(re.fullmatch(r"\w+", n) for n in names), f"{path.name}: only plain ${{name}} interpolations"
    assert names <= _template_var_names(), f"{path.name}: not passed by main.tf: {names - _template_var_names()}"
    missing = names - set(values)
    assert not missing, f"test sample lacks {missing}"
    return re.sub(r"\$\{(\w+)\}", lambda m: str(values[m.group(1)]), text)


def _sample_template_vars(**overrides) -> dict:
    """What workflows/main.tf passes to templatefile(), for one sample workflow."""
    extra_volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}]
    extra_mounts = [{"name": "models", "mountPath": "/models", "readOnly": True}]
    values = {
        "namespace": "specbatch",
        "workflow": "daily",
        "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/specbatch:0.1.0",
        "ray_version": "2.60.0",
        "service_account": "specbatch-ray",
        "job_config_uri": "/etc/specbatch/job.yaml",
        "output_uri": "s3://acme-data/outputs/support-chats/__RUN_DATE__/",
        "active_deadline_seconds": 24 * 3600,
        "head_cpu": "4",
        "head_memory": "16Gi",
        "worker_pods": 2,
        "gpus_per_worker": 1,
        "worker_cpu": "8",
        "worker_memory": "48Gi",
        "head_node_selector_json": json.dumps({"specbatch.io/pool": "system"}),
        "gpu_node_selector_json": json.dumps({"specbatch.io/pool": "gpu"}),
        "pod_security_context_json": json.dumps({"runAsNonRoot": True, "runAsUser": 1000,
                                                 "seccompProfile": {"type": "RuntimeDefault"}}),
        "container_security_context_json": json.dumps({"allowPrivilegeEscalation": False,
                                                       "capabilities": {"drop": ["ALL"]}}),
        "env_json": json.dumps([{"name": "AWS_REGION", "value": "us-east-1"}]),
        "runtime_env_yaml": json.dumps(json.dumps({"env_vars": {"SPECBATCH_WORKFLOW": "daily",
                                                                "SPECBATCH_RUN_DATE": "__RUN_DATE__"}})),
        "head_volumes_json": json.dumps([{"name": "job-config", "configMap": {
            "name": "specbatch-daily-config", "items": [{"key": "job.yaml", "path": "job.yaml"}]}}] + extra_volumes),
        "head_volume_mounts_json": json.dumps([{"name": "job-config", "mountPath": "/etc/specbatch",
                                                "readOnly": True}] + extra_mounts),
        "worker_volumes_json": json.dumps([{"name": "dshm", "emptyDir": {"medium": "Memory"}}] + extra_volumes),
        "worker_volume_mounts_json": json.dumps([{"name": "dshm", "mountPath": "/dev/shm"}] + extra_mounts),
    }
    values.update(overrides)
    return values


def _rayjob(template: str, run_date="2026-11-29", name="daily-20261129-020000") -> dict:
    text = _render_tf_template(WORKFLOW_TEMPLATES / template, _sample_template_vars())
    text = text.replace("__RUN_DATE__", run_date).replace("__RAYJOB_NAME__", name)
    (doc,) = list(yaml.safe_load_all(text))
    return doc


def _check_pod(pod: dict, container_name: str):
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "specbatch-ray"
    assert spec["securityContext"]["runAsNonRoot"] is True
    (container,) = [c for c in spec["containers"] if c["name"] == container_name]
    assert container["image"].endswith("specbatch:0.1.0")
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"] for v in spec.get("volumes", [])}
    assert mounts <= volumes, mounts - volumes
    return container


def test_generation_rayjob_has_what_kuberay_needs():
    job = _rayjob("rayjob-generate.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"] == "daily-20261129-020000" and job["metadata"]["namespace"] == "specbatch"
    spec = job["spec"]

    entry = spec["entrypoint"].split()
    assert entry[:2] == ["python", "/opt/specbatch/jobs/entrypoint.py"]
    assert entry[entry.index("--config") + 1] == "/etc/specbatch/job.yaml"
    assert entry[entry.index("--output-uri") + 1] == "s3://acme-data/outputs/support-chats/2026-11-29/"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])  # as Ray reads it
    assert runtime_env["env_vars"]["SPECBATCH_RUN_DATE"] == "2026-11-29"
    assert all(isinstance(v, str) for v in runtime_env["env_vars"].values())  # Ray wants Dict[str, str]
    assert "jsonencode(jsonencode(" in (MODULES / "workflows" / "main.tf").read_text()
    assert spec["shutdownAfterJobFinishes"] is True and spec["submissionMode"] == "K8sJobMode"
    assert spec["activeDeadlineSeconds"] > 0

    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]
    assert "rayStartParams" in head
    head_container = _check_pod(head["template"], "ray-head")
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    # The job config is mounted where --config points.
    (mount,) = [m for m in head_container["volumeMounts"] if m["name"] == "job-config"]
    (volume,) = [v for v in head["template"]["spec"]["volumes"] if v["name"] == "job-config"]
    assert f"{mount['mountPath']}/{volume['configMap']['items'][0]['path']}" == "/etc/specbatch/job.yaml"

    (workers,) = cluster["workerGroupSpecs"]
    assert workers["groupName"] and "rayStartParams" in workers
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 2
    worker = _check_pod(workers["template"], "ray-worker")
    gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
    assert isinstance(gpus, int) and gpus >= 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert workers["rayStartParams"]["num-gpus"] == str(gpus)
    tolerations = workers["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    assert workers["template"]["spec"]["nodeSelector"] == {"specbatch.io/pool": "gpu"}


def test_report_rayjob_runs_specbatch_report_on_the_same_dated_prefix():
    generate, report = _rayjob("rayjob-generate.yaml"), _rayjob("rayjob-report.yaml", name="daily-report-x")
    assert report["apiVersion"] == "ray.io/v1" and report["kind"] == "RayJob"
    out = generate["spec"]["entrypoint"].split("--output-uri ", 1)[1].split()[0]
    assert report["spec"]["entrypoint"].split() == ["specbatch", "report", out]
    head = report["spec"]["rayClusterSpec"]["headGroupSpec"]
    _check_pod(head["template"], "ray-head")
    assert report["spec"]["rayClusterSpec"]["workerGroupSpecs"] == []


def test_cron_job_schedules_runs_without_overlap(tfdirs):
    wf = tfdirs[MODULES / "workflows"]
    cron = wf.nested("resource")[("kubernetes_cron_job_v1", "workflow")]
    spec = cron["spec"][0]
    assert spec["schedule"] == "${each.value.schedule}"
    assert spec["concurrency_policy"] == "${each.value.concurrency_policy}"
    wf_type = wf.variables["workflows"]["type"]
    assert 'concurrency_policy = optional(string, "Forbid")' in (MODULES / "workflows" / "variables.tf").read_text()
    assert "schedule" in str(wf_type) and "dataset" in str(wf_type)
    pod = spec["job_template"][0]["spec"][0]["template"][0]["spec"][0]
    (container,) = pod["container"]
    assert container["command"] == ["/bin/sh", "/etc/specbatch-workflow/run.sh"]
    assert container["security_context"][0]["read_only_root_filesystem"] is True
    assert pod["restart_policy"] == "Never"
    # The dated prefix: OUTPUTS_PREFIX/<dataset>/<run date>/.
    assert "/${var.outputs_prefix}${w.dataset}/__RUN_DATE__/" in wf.text
    # The scheduler may only create and read RayJobs.
    (rule,) = wf.nested("resource")[("kubernetes_role_v1", "scheduler")]["rule"]
    assert rule["api_groups"] == ["ray.io"] and rule["resources"] == ["rayjobs"]
    assert set(rule["verbs"]) <= {"create", "get", "list", "watch"}


FAKE_KUBECTL = r"""#!/bin/sh
# Stands in for kubectl: records calls, stores created manifests, reports RayJob states.
echo "$*" >> "$FAKE_DIR/calls"
case "$1" in
  create) n=$(ls "$FAKE_DIR" | grep -c '^created-'); cat > "$FAKE_DIR/created-$n.yaml" ;;
  get)
    case "$*" in
      *jobDeploymentStatus*) echo Complete ;;
      *jobStatus*) case "$3" in *-report-*) echo "$FAKE_REPORT_STATUS" ;; *) echo "$FAKE_GENERATE_STATUS" ;; esac ;;
    esac ;;
esac
"""


def _run_scheduler(tmp_path: Path, generate_status: str) -> tuple[subprocess.CompletedProcess, list[dict], str]:
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX shell")
    templates = tmp_path / "templates"
    templates.mkdir()
    values = _sample_template_vars()
    for name in ("rayjob-generate.yaml", "rayjob-report.yaml"):
        (templates / name).write_text(_render_tf_template(WORKFLOW_TEMPLATES / name, values))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "kubectl").write_text(FAKE_KUBECTL)
    (fake / "kubectl").chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = {
        "PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}",
        "WORKFLOW": "daily", "NAMESPACE": "specbatch", "POLL_SECONDS": "0",
        "TEMPLATES": str(templates), "FAKE_DIR": str(state),
        "FAKE_GENERATE_STATUS": generate_status, "FAKE_REPORT_STATUS": "SUCCEEDED",
    }
    proc = subprocess.run([sh, str(WORKFLOW_TEMPLATES / "run.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    created = [yaml.safe_load(p.read_text()) for p in sorted(state.glob("created-*.yaml"))]
    return proc, created, (state / "calls").read_text() if (state / "calls").exists() else ""


def test_scheduler_creates_generation_then_report_on_the_dated_prefix(tmp_path):
    before = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    proc, created, calls = _run_scheduler(tmp_path, "SUCCEEDED")
    after = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert proc.returncode == 0, proc.stderr
    assert [j["metadata"]["labels"]["app.kubernetes.io/component"] for j in created] == ["generate", "report"]
    generate, report = created
    run_date = generate["metadata"]["labels"]["specbatch.io/run-date"]
    assert run_date in (before, after)
    out = f"s3://acme-data/outputs/support-chats/{run_date}/"
    assert generate["spec"]["entrypoint"].endswith(f"--output-uri {out}")
    assert report["spec"]["entrypoint"] == f"specbatch report {out}"
    assert re.fullmatch(r"daily-\d{8}-\d{6}", generate["metadata"]["name"])
    assert report["metadata"]["name"] == generate["metadata"]["name"].replace("daily-", "daily-report-", 1)
    assert "__" not in json.dumps(created)
    assert calls.splitlines()[0].startswith("create -n specbatch -f -")


def test_scheduler_skips_the_report_and_fails_when_generation_fails(tmp_path):
    proc, created, _ = _run_scheduler(tmp_path, "FAILED")
    assert proc.returncode != 0
    assert [j["metadata"]["labels"]["app.kubernetes.io/component"] for j in created] == ["generate"]


# --- Example environment -------------------------------------------------------------------------------


def test_example_job_config_is_a_valid_job_config():
    import pipeline.config as config
    text = (EXAMPLE / "job-config.yaml").read_text()
    values = {
        "job_name": "support-chats-daily", "input_uri": "s3://acme-data/prompts/support-chats/",
        "output_uri": "s3://acme-data/outputs/support-chats/unscheduled/", "target_model_path": "/models/target",
        "drafter_model_path": "/models/drafter", "tensor_parallel_size": 2, "replicas": 2,
        "accelerator": "nvidia-l40s", "region": "us-east-1",
    }
    names = set(re.findall(r"\$\{(\w+)\}", text))
    assert names == set(values)
    rendered = re.sub(r"\$\{(\w+)\}", lambda m: str(values[m.group(1)]), text)
    job = config.parse_config(yaml.safe_load(rendered), source="job-config.yaml")
    assert job.resources.gpus_per_replica == job.engine.tensor_parallel_size == 2
    main = (EXAMPLE / "main.tf").read_text()
    for name in names:
        assert re.search(rf"^\s+{name}\s+=", main, flags=re.M), f"main.tf does not pass {name}"


def test_example_wires_the_workflow(tfdirs):
    example = tfdirs[EXAMPLE]
    wf = example.modules["workflows"]
    assert wf["ray_role_arn"] == "${module.identity.role_arn}"
    assert wf["gpu_node_selector"] == "${module.cluster.gpu_node_selector}"
    identity = example.modules["identity"]
    assert identity["service_account"] == wf["service_account"] == "${local.ray_service_account}"
    assert identity["namespace"] == wf["namespace"] == "${var.namespace}"
    assert (EXAMPLE / "terraform.tfvars.example").is_file()


# --- Dockerfile ---------------------------------------------------------------------------------------


def test_dockerfile():
    lines = [l.strip() for l in (INFRA / "docker" / "Dockerfile").read_text().splitlines()]
    instructions = [l for l in lines if l and not l.startswith("#")]
    froms = [l.split()[1] for l in instructions if l.upper().startswith("FROM ")]
    assert froms and all(":" in f and not f.endswith(":latest") for f in froms), froms
    assert "2.60.0" in froms[-1]
    users = [l.split()[1] for l in instructions if l.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(l.upper().startswith("HEALTHCHECK ") for l in instructions)
    text = "\n".join(instructions)
    assert '".[cuda]"' in text or "'.[cuda]'" in text or ".[cuda]" in text
    assert re.search(r"^COPY .*\bjobs\b", text, flags=re.M)
    assert "/opt/specbatch/jobs/entrypoint.py" in (WORKFLOW_TEMPLATES / "rayjob-generate.yaml").read_text()
    assert re.search(r"^WORKDIR /opt/specbatch$", text, flags=re.M)


# --- checkov ---------------------------------------------------------------------------------------------


def _checkov() -> str | None:
    for candidate in (os.environ.get("CHECKOV"), str(ROOT / ".venv" / "checkov" / "bin" / "checkov"),
                      shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def checkov_reports() -> list[dict]:
    exe = _checkov()
    if exe is None:
        pytest.fail("checkov not found: run `make test` (it installs checkov into .venv/checkov) or set CHECKOV")
    # Offline: no platform download, no update check.
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE", CKV_SKIP_PACKAGE_UPDATE_CHECK="true", LOG_LEVEL="WARNING")
    proc = subprocess.run(
        [exe, "--directory", str(INFRA), "--output", "json", "--skip-download",
         "--download-external-modules", "false", "--compact"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    reports = data if isinstance(data, list) else [data]
    assert reports and all("summary" in r for r in reports), proc.stdout[:2000]
    return reports


def test_checkov_reports_no_failed_checks(checkov_reports):
    frameworks = {r["check_type"] for r in checkov_reports}
    assert {"terraform", "dockerfile"} <= frameworks, frameworks
    failures = []
    for r in checkov_reports:
        assert r["summary"]["parsing_errors"] == 0, (r["check_type"], r["summary"])
        for f in r["results"].get("failed_checks", []):
            failures.append(f"{f['check_id']} {f['resource']} {f['file_path']}:{f['file_line_range']}")
    assert not failures, "\n".join(failures)
    assert sum(r["summary"]["passed"] for r in checkov_reports) > 100


def test_every_checkov_skip_is_justified_in_place(checkov_reports):
    comments = []
    for path in INFRA.rglob("*"):
        if path.is_file() and path.suffix in (".tf", ".yaml", ".yml", "") or path.name == "Dockerfile":
            for line in path.read_text(errors="ignore").splitlines():
                if "checkov:skip=" in line:
                    comments.append(line.strip())
    ids = set()
    for c in comments:
        m = re.search(r"checkov:skip=(CKV2?_[A-Z0-9]+_\d+):\s*(.+)", c)
        assert m and len(m.group(2).strip()) >= 30, f"skip without a real reason: {c}"
        ids.add(m.group(1))
    skipped = [s for r in checkov_reports for s in r["results"].get("skipped_checks", [])]
    for s in skipped:
        assert s["check_id"] in ids, f"{s['check_id']} skipped without an in-place justification"
