# The two RayJobs of one workflow (generation, cost report), both rendered from
# jobs/kuberay/rayjob.yaml (manifests.tf), and the sizes of their pods, derived from or checked
# against the node types they run on. run.sh fills in __RAYJOB_NAME__ and __RUN_DATE__ at run time.

locals {
  # Quantities in millicores and MiB. An unparsable one is null and fails a check below.
  mem_units = { "" = 1 / 1048576, Ki = 1 / 1024, Mi = 1, Gi = 1024, Ti = 1048576, K = 1000 / 1048576, M = 1000000 / 1048576, G = 1000000000 / 1048576, T = 1000000000000 / 1048576 }
  quantity  = "^([0-9]+(?:\\.[0-9]+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?$"

  raw_cpu    = { worker = var.worker_cpu, head = var.head_cpu, reserve = var.daemonset_reserve.cpu }
  raw_memory = { worker = var.worker_memory, shm = var.shm_size, head = var.head_memory, reserve = var.daemonset_reserve.memory }
  cpu_m = { for k, v in local.raw_cpu : k => v == null ? null : try(
    tonumber(regex("^([0-9]+)m$", v)[0]),
    tonumber(regex("^[0-9]+(?:\\.[0-9]+)?$", v)) * 1000,
    null,
  ) }
  memory_parts = { for k, v in local.raw_memory : k => try(regex(local.quantity, v), null) }
  memory_mi    = { for k, p in local.memory_parts : k => p == null ? null : tonumber(p[0]) * local.mem_units[p[1] == null ? "" : p[1]] }
  unparsable = concat(
    [for k, v in local.raw_cpu : "${k} CPU \"${v}\"" if v != null && local.cpu_m[k] == null],
    [for k, v in local.raw_memory : "${k} memory \"${v}\"" if v != null && local.memory_mi[k] == null],
  )

  reserve_cpu_m     = coalesce(local.cpu_m.reserve, 0)
  reserve_memory_mi = coalesce(local.memory_mi.reserve, 0)

  # The GPU node type that gives a pod the least of each resource; every type must fit a worker.
  unknown_gpu_types = [for t in var.gpu_instance_types : t if !contains(keys(local.gpu_instance_types), t)]
  known_gpu_types   = [for t in var.gpu_instance_types : t if contains(keys(local.gpu_instance_types), t)]
  gpu_node = length(local.known_gpu_types) == 0 ? { cpu_m = 0, memory_mi = 0, gpus = 0 } : {
    cpu_m     = min([for t in local.known_gpu_types : local.allocatable[t].cpu_m]...) - local.reserve_cpu_m
    memory_mi = min([for t in local.known_gpu_types : local.allocatable[t].memory_mi]...) - local.reserve_memory_mi
    gpus      = min([for t in local.known_gpu_types : local.allocatable[t].gpus]...)
  }
  unknown_head_types = [for t in var.head_instance_types : t if !contains(keys(local.cpu_instance_types), t)]
  known_head_types   = [for t in var.head_instance_types : t if contains(keys(local.cpu_instance_types), t)]
  head_node = length(local.known_head_types) == 0 ? null : {
    cpu_m     = min([for t in local.known_head_types : local.allocatable[t].cpu_m]...) - local.reserve_cpu_m
    memory_mi = min([for t in local.known_head_types : local.allocatable[t].memory_mi]...) - local.reserve_memory_mi
  }

  # Engine replicas: a fixed pool of replicas, or a pool that starts at replicas and that Ray
  # Data grows up to max_replicas as the Ray autoscaler adds worker pods.
  max_replicas = coalesce(var.max_replicas, var.replicas)

  # Default: the replicas' GPUs (of the largest pool), up to a whole node, in whole replicas; CPU
  # and memory in proportion to the node's GPUs the worker takes, so that smaller workers can
  # share a node.
  node_gpus           = max(local.gpu_node.gpus, 1)
  replicas_per_node   = max(floor(local.node_gpus / var.gpus_per_replica), 1)
  gpus_per_worker     = coalesce(var.gpus_per_worker, min(local.max_replicas, local.replicas_per_node) * var.gpus_per_replica)
  worker_share        = min(local.gpus_per_worker / local.node_gpus, 1)
  worker_cpu_m        = coalesce(local.cpu_m.worker, floor(local.gpu_node.cpu_m * local.worker_share / 100) * 100)
  worker_memory_mi    = coalesce(local.memory_mi.worker, floor(local.gpu_node.memory_mi * local.worker_share / 1024) * 1024)
  shm_mi              = coalesce(local.memory_mi.shm, max(floor(local.worker_memory_mi * 0.3 / 1024), 1) * 1024)
  replicas_per_worker = max(floor(local.gpus_per_worker / var.gpus_per_replica), 1)
  worker_pods         = ceil(var.replicas / local.replicas_per_worker)
  max_worker_pods     = ceil(local.max_replicas / local.replicas_per_worker)

  # GPU workers: a fixed pool has replicas = minReplicas = maxReplicas and no autoscaler, as
  # before max_replicas existed. When max_replicas needs more worker pods than replicas, a run
  # starts minReplicas of them and KubeRay's in-tree Ray autoscaler (a sidecar of the head)
  # adds workers up to maxReplicas while the engine pool asks for GPUs. Either way KubeRay
  # recreates a worker pod that is lost. The job config carries the same range, so that the
  # pipeline's engine pool and the worker group agree; a fixed pool stays a plain number there.
  autoscaling         = local.max_worker_pods > local.worker_pods
  replica_range       = local.max_replicas > var.replicas
  job_config_replicas = local.replica_range ? "{min: ${var.replicas}, max: ${local.max_replicas}}" : tostring(var.replicas)
  replicas_json       = local.replica_range ? jsonencode({ min = var.replicas, max = local.max_replicas }) : jsonencode(var.replicas)
  job_config_replicas_json = var.job_config_yaml == "" ? local.replicas_json : try(
    jsonencode(yamldecode(var.job_config_yaml).resources.replicas),
    jsonencode(1), # resources.replicas left out: the pipeline's default
  )

  # KubeRay's default size of the autoscaler sidecar, written out: it counts against the head's node.
  autoscaler_resources = { cpu = "500m", memory = "512Mi" }
  head_extra           = local.autoscaling ? { cpu_m = 500, memory_mi = 512 } : { cpu_m = 0, memory_mi = 0 }
  # The head pod mounts no service account token (its containers run the job's code); only the
  # autoscaler sidecar gets one, which it needs to patch the RayCluster's worker replicas.
  autoscaler_token_volume = {
    name = "autoscaler-api-token"
    projected = {
      sources = [
        { serviceAccountToken = { path = "token", expirationSeconds = 3607 } },
        { configMap = { name = "kube-root-ca.crt", items = [{ key = "ca.crt", path = "ca.crt" }] } },
        { downwardAPI = { items = [{ path = "namespace", fieldRef = { apiVersion = "v1", fieldPath = "metadata.namespace" } }] } },
      ]
    }
  }
  autoscaler_options = {
    upscalingMode      = "Default"
    idleTimeoutSeconds = var.autoscaler_idle_timeout_seconds
    resources          = { requests = local.autoscaler_resources, limits = local.autoscaler_resources }
    securityContext    = local.container_security_context
    volumeMounts       = [{ name = local.autoscaler_token_volume.name, mountPath = "/var/run/secrets/kubernetes.io/serviceaccount", readOnly = true }]
  }

  sizing = {
    gpu_instance_types = var.gpu_instance_types
    node_cpu_m         = local.gpu_node.cpu_m
    node_memory_mi     = local.gpu_node.memory_mi
    node_gpus          = local.gpu_node.gpus
    worker_pods        = local.worker_pods
    max_worker_pods    = local.max_worker_pods
    autoscaling        = local.autoscaling
    gpus_per_worker    = local.gpus_per_worker
    worker_cpu         = "${local.worker_cpu_m}m"
    worker_memory      = "${floor(local.worker_memory_mi)}Mi"
    shm_size           = "${floor(local.shm_mi)}Mi"
    worker_num_cpus    = max(floor(local.worker_cpu_m / 1000), 1)
  }

  # How long a scheduler pod can live: the generation deadline (pending pods included), the
  # report's, and slack for polling and cleanup. Forbid holds the next run until it ends.
  scheduler_seconds = var.timeout_hours * 3600 + var.report_timeout_seconds + 1800
  daily             = contains(["@daily", "@midnight"], trimspace(var.schedule)) || can(regex("^[0-9]+ [0-9]+ \\* \\* \\*$", trimspace(var.schedule)))
}
