# Scheduled dataset generation on KubeRay. Per workflow:
#   ConfigMap <name>-config     the job config (job.yaml), mounted into the Ray head;
#   ConfigMap <name>-scheduler  the two RayJob templates (generation, cost report) and run.sh;
#   CronJob   specbatch-<name>  on schedule, runs run.sh: generation RayJob on the dated
#                               prefix, then the report RayJob on the same prefix.
# The Ray pods run as one service account bound to the IRSA role; the scheduler pods run as
# another that may only create and read RayJobs in this namespace.

locals {
  namespace = var.create_namespace ? kubernetes_namespace_v1.this[0].metadata[0].name : var.namespace
  labels    = merge({ "app.kubernetes.io/name" = "specbatch", "app.kubernetes.io/managed-by" = "terraform" }, var.labels)

  pod_security_context = {
    runAsNonRoot   = true
    runAsUser      = 1000
    runAsGroup     = 100
    fsGroup        = 100
    seccompProfile = { type = "RuntimeDefault" }
  }
  container_security_context = {
    allowPrivilegeEscalation = false
    privileged               = false
    capabilities             = { drop = ["ALL"] }
  }
  pod_env = [
    { name = "AWS_REGION", value = var.aws_region },
    { name = "AWS_DEFAULT_REGION", value = var.aws_region },
  ]

  workflows = {
    for name, w in var.workflows : name => merge(w, {
      config_map  = "specbatch-${name}-config"
      output_uri  = "s3://${var.bucket_name}/${var.outputs_prefix}${w.dataset}/__RUN_DATE__/"
      worker_pods = ceil(w.replicas / floor(w.gpus_per_worker / w.gpus_per_replica))
    })
  }

  template_vars = {
    for name, w in local.workflows : name => {
      namespace                       = local.namespace
      workflow                        = name
      image                           = var.image
      ray_version                     = var.ray_version
      service_account                 = kubernetes_service_account_v1.ray.metadata[0].name
      job_config_uri                  = w.job_config_uri
      output_uri                      = w.output_uri
      active_deadline_seconds         = w.timeout_hours * 3600
      head_cpu                        = var.head_cpu
      head_memory                     = var.head_memory
      worker_pods                     = w.worker_pods
      gpus_per_worker                 = w.gpus_per_worker
      worker_cpu                      = w.worker_cpu
      worker_memory                   = w.worker_memory
      head_node_selector_json         = jsonencode(var.head_node_selector)
      gpu_node_selector_json          = jsonencode(var.gpu_node_selector)
      pod_security_context_json       = jsonencode(local.pod_security_context)
      container_security_context_json = jsonencode(local.container_security_context)
      env_json                        = jsonencode(local.pod_env)
      # JSON (a subset of YAML) keeps every value a quoted string, also once run.sh has put
      # the date in (a bare 2026-11-29 would load as a date, which Ray's env_vars refuse).
      runtime_env_yaml = jsonencode(jsonencode({
        env_vars = merge(w.env, {
          SPECBATCH_WORKFLOW = name
          SPECBATCH_DATASET  = w.dataset
          SPECBATCH_RUN_DATE = "__RUN_DATE__"
        })
      }))
      head_volumes_json = jsonencode(concat(
        [{ name = "job-config", configMap = { name = w.config_map, items = [{ key = "job.yaml", path = "job.yaml" }] } }],
        var.extra_volumes,
      ))
      head_volume_mounts_json = jsonencode(concat(
        [{ name = "job-config", mountPath = "/etc/specbatch", readOnly = true }],
        var.extra_volume_mounts,
      ))
      worker_volumes_json = jsonencode(concat(
        [{ name = "dshm", emptyDir = { medium = "Memory", sizeLimit = w.shm_size } }],
        var.extra_volumes,
      ))
      worker_volume_mounts_json = jsonencode(concat(
        [{ name = "dshm", mountPath = "/dev/shm" }],
        var.extra_volume_mounts,
      ))
    }
  }

  rayjobs = {
    for name, vars in local.template_vars : name => {
      generate = templatefile("${path.module}/templates/rayjob-generate.yaml", vars)
      report   = templatefile("${path.module}/templates/rayjob-report.yaml", vars)
    }
  }
}

resource "kubernetes_namespace_v1" "this" {
  count = var.create_namespace ? 1 : 0
  metadata {
    name   = var.namespace
    # Ray pods meet "restricted"; KubeRay's default submitter pod only "baseline".
    labels = merge(local.labels, {
      "pod-security.kubernetes.io/enforce" = "baseline"
      "pod-security.kubernetes.io/warn"    = "restricted"
      "pod-security.kubernetes.io/audit"   = "restricted"
    })
  }
}

# --- The Ray pods' identity (IRSA) ---------------------------------------------------------

resource "kubernetes_service_account_v1" "ray" {
  metadata {
    name        = var.service_account
    namespace   = local.namespace
    labels      = local.labels
    annotations = { "eks.amazonaws.com/role-arn" = var.ray_role_arn }
  }
  # The Ray pods never call the Kubernetes API; IRSA projects its own token.
  automount_service_account_token = false
}

# --- Per workflow: job config and RayJob templates -------------------------------------------

resource "kubernetes_config_map_v1" "job_config" {
  for_each = local.workflows
  metadata {
    name      = each.value.config_map
    namespace = local.namespace
    labels    = merge(local.labels, { "specbatch.io/workflow" = each.key })
  }
  data = { "job.yaml" = each.value.job_config_yaml }
}

resource "kubernetes_config_map_v1" "scheduler" {
  for_each = local.workflows
  metadata {
    name      = "specbatch-${each.key}-scheduler"
    namespace = local.namespace
    labels    = merge(local.labels, { "specbatch.io/workflow" = each.key })
  }
  data = {
    "rayjob-generate.yaml" = local.rayjobs[each.key].generate
    "rayjob-report.yaml"   = local.rayjobs[each.key].report
    "run.sh"               = file("${path.module}/templates/run.sh")
  }
}
