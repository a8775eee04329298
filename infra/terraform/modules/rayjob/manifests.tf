# The workflow's two RayJobs, rendered from jobs/kuberay/rayjob.yaml: the manifest that
# `kubectl apply -k jobs/kuberay` runs on any KubeRay cluster. Its structure and policies are
# kept (submission mode, shutdown, backoff, security contexts, ports, tolerations, the offline
# environment); what this module sizes and names is replaced. One manifest, two ways to run it.

locals {
  base                       = yamldecode(file("${path.module}/../../../../jobs/kuberay/rayjob.yaml"))
  base_cluster               = local.base.spec.rayClusterSpec
  base_head                  = local.base_cluster.headGroupSpec
  base_worker                = local.base_cluster.workerGroupSpecs[0]
  base_head_pod              = local.base_head.template.spec
  base_worker_pod            = local.base_worker.template.spec
  base_head_box              = local.base_head_pod.containers[0]
  base_worker_box            = local.base_worker_pod.containers[0]
  pod_labels                 = merge(local.base_head.template.metadata.labels, { "specbatch.io/workflow" = var.workflow })
  job_labels                 = merge(local.base.metadata.labels, { "specbatch.io/workflow" = var.workflow, "specbatch.io/run-date" = "__RUN_DATE__" })
  job_metadata               = { name = "__RAYJOB_NAME__", namespace = var.namespace, labels = local.job_labels }
  pod_security_context       = local.base_head_pod.securityContext
  container_security_context = local.base_head_box.securityContext

  # The base's offline environment (the image holds the models' code, the weights come from
  # storage or a volume, never a hub), as in `ray job submit --runtime-env jobs/runtime_env.yaml`.
  # Credentials come from IRSA, so the base's optional storage Secret (envFrom) is left out.
  offline_env = { for e in local.base_head_box.env : e.name => e.value }
  pod_env = concat(
    [
      { name = "AWS_REGION", value = var.aws_region },
      { name = "AWS_DEFAULT_REGION", value = var.aws_region },
    ],
    local.base_head_box.env,
  )
  # JSON (a subset of YAML) keeps every value a quoted string, also once run.sh has put the
  # date in (a bare 2026-11-29 would load as a date, which Ray's env_vars refuse).
  runtime_env_json = jsonencode({
    env_vars = merge(local.offline_env, var.env, {
      SPECBATCH_WORKFLOW = var.workflow
      SPECBATCH_DATASET  = var.dataset
      SPECBATCH_RUN_DATE = "__RUN_DATE__"
    })
  })
  job_spec = {
    runtimeEnvYAML            = local.runtime_env_json
    ttlSecondsAfterFinished   = var.ttl_seconds_after_finished
    preRunningDeadlineSeconds = var.pre_running_deadline_seconds
  }

  head_container = merge({ for k, v in local.base_head_box : k => v if k != "envFrom" }, {
    image        = var.image
    env          = local.pod_env
    resources    = { requests = { cpu = var.head_cpu, memory = var.head_memory }, limits = { cpu = var.head_cpu, memory = var.head_memory } }
    volumeMounts = concat([{ name = "job-config", mountPath = "/etc/specbatch", readOnly = true }], var.extra_volume_mounts)
  })
  head_pod = merge(local.base_head_pod, {
    serviceAccountName = var.service_account
    nodeSelector       = var.head_node_selector
    containers         = [local.head_container]
    volumes = concat(
      [{ name = "job-config", configMap = { name = var.job_config_map, items = [{ key = "job.yaml", path = "job.yaml" }] } }],
      var.extra_volumes,
      local.autoscaling ? [local.autoscaler_token_volume] : [],
    )
  })
  worker_resources = { cpu = local.sizing.worker_cpu, memory = local.sizing.worker_memory, "nvidia.com/gpu" = local.gpus_per_worker }
  worker_container = merge({ for k, v in local.base_worker_box : k => v if k != "envFrom" }, {
    image        = var.image
    env          = local.pod_env
    resources    = { requests = local.worker_resources, limits = local.worker_resources }
    volumeMounts = concat([{ name = "dshm", mountPath = "/dev/shm" }], var.extra_volume_mounts)
  })
  worker_pod = merge(local.base_worker_pod, {
    serviceAccountName = var.service_account
    nodeSelector       = var.gpu_node_selector
    containers         = [local.worker_container]
    volumes            = concat([{ name = "dshm", emptyDir = { medium = "Memory", sizeLimit = local.sizing.shm_size } }], var.extra_volumes)
  })

  generate = merge(local.base, {
    metadata = local.job_metadata
    spec = merge(local.base.spec, local.job_spec, {
      entrypoint            = "python /opt/specbatch/jobs/entrypoint.py --config ${var.job_config_uri} --output-uri ${var.output_uri}"
      activeDeadlineSeconds = var.timeout_hours * 3600
      rayClusterSpec = merge(local.base_cluster, {
        rayVersion              = var.ray_version
        enableInTreeAutoscaling = local.autoscaling
        headGroupSpec           = merge(local.base_head, { template = { metadata = { labels = local.pod_labels }, spec = local.head_pod } })
        workerGroupSpecs = [merge(local.base_worker, {
          replicas       = local.worker_pods
          minReplicas    = local.worker_pods
          maxReplicas    = local.max_worker_pods
          rayStartParams = { "num-cpus" = tostring(local.sizing.worker_num_cpus), "num-gpus" = tostring(local.gpus_per_worker) }
          template       = { metadata = { labels = local.pod_labels }, spec = local.worker_pod }
        })]
      }, local.autoscaling ? { autoscalerOptions = local.autoscaler_options } : null)
    })
  })

  # `specbatch report` on the run's dated prefix (report/ next to the data): the head alone,
  # where the report runs (so it offers Ray its CPUs), no GPU workers.
  report_resources = { cpu = "2", memory = "8Gi" }
  report_container = merge({ for k, v in local.head_container : k => v if k != "volumeMounts" }, {
    resources = { requests = local.report_resources, limits = local.report_resources }
  })
  report = merge(local.base, {
    metadata = merge(local.job_metadata, { labels = merge(local.job_labels, { "app.kubernetes.io/component" = "report" }) })
    spec = merge(local.base.spec, local.job_spec, {
      entrypoint            = "specbatch report ${var.output_uri}"
      activeDeadlineSeconds = var.report_timeout_seconds
      rayClusterSpec = merge(local.base_cluster, {
        rayVersion              = var.ray_version
        enableInTreeAutoscaling = false
        headGroupSpec = merge(local.base_head, {
          rayStartParams = { for k, v in local.base_head.rayStartParams : k => v if k != "num-cpus" }
          template = {
            metadata = { labels = local.pod_labels }
            spec     = merge({ for k, v in local.head_pod : k => v if k != "volumes" }, { containers = [local.report_container] })
          }
        })
        workerGroupSpecs = []
      })
    })
  })
}
