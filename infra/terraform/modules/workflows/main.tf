# Scheduled dataset generation on KubeRay. Per workflow:
#   ConfigMap <name>-config     the job config (job.yaml), mounted into the Ray head;
#   ConfigMap <name>-scheduler  the two RayJob manifests (generation, cost report; rendered
#                               by modules/rayjob) and run.sh;
#   CronJob   specbatch-<name>  on schedule, runs run.sh: generation RayJob on the dated
#                               prefix (or, with output = "per_dataset", on the data set's one
#                               prefix, where each run adds only new input files), then the
#                               report RayJob on the same prefix.
# The Ray pods run as one service account bound to the IRSA role; the scheduler pods run as
# another that may only create and read RayJobs in this namespace.

locals {
  namespace = var.create_namespace ? kubernetes_namespace_v1.this[0].metadata[0].name : var.namespace
  labels    = merge({ "app.kubernetes.io/name" = "specbatch", "app.kubernetes.io/managed-by" = "terraform" }, var.labels)

  workflows = {
    for name, w in var.workflows : name => merge(w, {
      config_map = "specbatch-${name}-config"
      output_uri = (w.output == "per_dataset" ? "s3://${var.bucket_name}/${var.outputs_prefix}${w.dataset}/"
      : "s3://${var.bucket_name}/${var.outputs_prefix}${w.dataset}/__RUN_DATE__/")
    })
  }
}

# Sizes and manifests of each workflow's RayJobs; provider-free, so tests plan it offline.
module "rayjob" {
  source   = "../rayjob"
  for_each = local.workflows

  workflow                     = each.key
  schedule                     = each.value.schedule
  namespace                    = local.namespace
  image                        = var.image
  ray_version                  = var.ray_version
  service_account              = kubernetes_service_account_v1.ray.metadata[0].name
  aws_region                   = var.aws_region
  dataset                      = each.value.dataset
  output_uri                   = each.value.output_uri
  job_config_uri               = each.value.job_config_uri
  job_config_map               = each.value.config_map
  job_config_yaml              = each.value.job_config_yaml
  replicas                     = each.value.replicas
  max_replicas                 = each.value.max_replicas
  gpus_per_replica             = each.value.gpus_per_replica
  gpus_per_worker              = each.value.gpus_per_worker
  worker_cpu                   = each.value.worker_cpu
  worker_memory                = each.value.worker_memory
  shm_size                     = each.value.shm_size
  gpu_instance_types           = var.gpu_instance_types
  head_instance_types          = var.head_instance_types
  head_cpu                     = var.head_cpu
  head_memory                  = var.head_memory
  head_node_selector           = var.head_node_selector
  gpu_node_selector            = var.gpu_node_selector
  timeout_hours                = each.value.timeout_hours
  pre_running_deadline_seconds = each.value.pre_running_deadline_minutes * 60
  ttl_seconds_after_finished   = var.ttl_seconds_after_finished
  report_timeout_seconds       = var.report_timeout_seconds
  env                          = each.value.env
  extra_volumes                = var.extra_volumes
  extra_volume_mounts          = var.extra_volume_mounts
}

resource "kubernetes_namespace_v1" "this" {
  count = var.create_namespace ? 1 : 0
  metadata {
    name = var.namespace
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

# --- Per workflow: job config and RayJob manifests -------------------------------------------

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
    "rayjob-generate.yaml" = module.rayjob[each.key].generate
    "rayjob-report.yaml"   = module.rayjob[each.key].report
    "run.sh"               = file("${path.module}/templates/run.sh")
  }
}
