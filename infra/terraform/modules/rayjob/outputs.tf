output "sizing" {
  description = "What a GPU node gives a pod (after kubelet reservations and DaemonSets) and the worker pods' sizes."
  value       = local.sizing

  precondition {
    condition     = var.replicas >= 1 && floor(var.replicas) == var.replicas
    error_message = "workflow ${var.workflow}: replicas = ${var.replicas} must be a whole number of at least 1: the engine pool starts with that many engines (Ray Data's min_size), and a pool of none would never start one."
  }
  precondition {
    condition     = floor(local.max_replicas) == local.max_replicas && local.max_replicas >= var.replicas
    error_message = "workflow ${var.workflow}: max_replicas (${local.max_replicas}) must be a whole number no smaller than replicas (${var.replicas}), the pool's minimum. Raise max_replicas, or leave it unset for a fixed pool of replicas."
  }
  precondition {
    condition     = local.job_config_replicas_json == local.replicas_json
    error_message = "workflow ${var.workflow}: the job config's resources.replicas is ${local.job_config_replicas_json}, but replicas and max_replicas make the worker group ${local.job_config_replicas}: the job's engine pool and the Ray autoscaler would disagree. Write `replicas: ${local.job_config_replicas}` under resources in the job config."
  }
  precondition {
    condition     = length(local.unparsable) == 0
    error_message = "workflow ${var.workflow}: cannot read ${join(", ", local.unparsable)}: write CPU as \"4\" or \"3500m\" and memory as \"48Gi\" or \"49152Mi\"."
  }
  precondition {
    condition     = length(local.unknown_gpu_types) == 0 && length(var.gpu_instance_types) > 0
    error_message = "workflow ${var.workflow}: no sizing for GPU instance type(s) ${jsonencode(local.unknown_gpu_types)}. Use one of ${join(", ", sort(keys(local.gpu_instance_types)))}, or add the type's vCPUs, memory, GPUs and max pods to infra/terraform/modules/rayjob/instance_types.tf."
  }
  precondition {
    condition     = var.gpus_per_replica <= local.gpu_node.gpus
    error_message = "workflow ${var.workflow}: a replica needs ${var.gpus_per_replica} GPUs on one pod (tensor_parallel_size), but ${join("/", var.gpu_instance_types)} has ${local.gpu_node.gpus}. Choose an instance type with at least ${var.gpus_per_replica} GPUs or lower tensor_parallel_size."
  }
  precondition {
    condition     = local.gpus_per_worker <= local.gpu_node.gpus && local.gpus_per_worker % var.gpus_per_replica == 0
    error_message = "workflow ${var.workflow}: gpus_per_worker = ${local.gpus_per_worker} must be a multiple of gpus_per_replica (${var.gpus_per_replica}) and at most the ${local.gpu_node.gpus} GPUs of ${join("/", var.gpu_instance_types)}. Leave it unset to derive it."
  }
  precondition {
    condition     = local.worker_cpu_m <= local.gpu_node.cpu_m && local.worker_memory_mi <= local.gpu_node.memory_mi
    error_message = "workflow ${var.workflow}: a GPU worker asks for ${local.worker_cpu_m}m CPU and ${floor(local.worker_memory_mi)}Mi, but ${join("/", var.gpu_instance_types)} gives a pod at most ${local.gpu_node.cpu_m}m CPU and ${local.gpu_node.memory_mi}Mi (after kubelet reservations and DaemonSets), so the workers would stay Pending. Leave worker_cpu and worker_memory unset to size workers from the instance type, or choose a larger instance type."
  }
  precondition {
    condition     = local.shm_mi <= local.worker_memory_mi / 2
    error_message = "workflow ${var.workflow}: shm_size (${floor(local.shm_mi)}Mi) counts against the worker's memory (${floor(local.worker_memory_mi)}Mi) and must be at most half of it. Lower shm_size or leave it unset (30% of the worker's memory)."
  }
  precondition {
    condition     = length(local.unknown_head_types) == 0
    error_message = "workflow ${var.workflow}: no sizing for head instance type(s) ${jsonencode(local.unknown_head_types)}. Use one of ${join(", ", sort(keys(local.cpu_instance_types)))}, or add the type to infra/terraform/modules/rayjob/instance_types.tf."
  }
  precondition {
    condition = local.head_node == null || (
      coalesce(local.cpu_m.head, 0) + local.head_extra.cpu_m <= try(local.head_node.cpu_m, 0) &&
      coalesce(local.memory_mi.head, 0) + local.head_extra.memory_mi <= try(local.head_node.memory_mi, 0)
    )
    error_message = "workflow ${var.workflow}: the Ray head asks for ${var.head_cpu} CPU and ${var.head_memory}${local.autoscaling ? " (and its autoscaler sidecar ${local.autoscaler_resources.cpu} and ${local.autoscaler_resources.memory})" : ""}, more than ${join("/", var.head_instance_types)} gives a pod (${try(local.head_node.cpu_m, 0)}m, ${try(local.head_node.memory_mi, 0)}Mi). Lower head_cpu/head_memory or choose larger system_instance_types."
  }
}

output "scheduler_seconds" {
  description = "Deadline of a scheduler pod (activeDeadlineSeconds of the CronJob's Job): generation, report and slack."
  value       = local.scheduler_seconds

  precondition {
    condition     = !local.daily || local.scheduler_seconds <= 86400
    error_message = "workflow ${var.workflow} runs daily, but a run may take up to ${local.scheduler_seconds / 3600} h (timeout_hours ${var.timeout_hours} + report ${var.report_timeout_seconds / 3600} h + 0.5 h), so the next day's run would wait behind it. Lower timeout_hours to at most ${floor((86400 - var.report_timeout_seconds - 1800) / 3600)}."
  }
}

output "worker_pods" {
  description = "GPU worker pods a generation run starts with (all of them for a fixed pool; sizing.max_worker_pods is the most an autoscaling one grows to)."
  value       = local.worker_pods
}

output "job_config_replicas" {
  description = "resources.replicas the run's job config must carry, as YAML: a number for a fixed pool, {min: N, max: M} for an autoscaling one."
  value       = local.job_config_replicas
}

output "generate" {
  description = "Generation RayJob; run.sh replaces __RAYJOB_NAME__ and __RUN_DATE__."
  value       = yamlencode(local.generate)
}

output "report" {
  description = "Cost-report RayJob on the same dated prefix; run.sh replaces __RAYJOB_NAME__ and __RUN_DATE__."
  value       = yamlencode(local.report)
}
