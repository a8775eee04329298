output "bucket_name" {
  description = "Data bucket; upload prompt shards to s3://BUCKET/PROMPTS_PREFIX<dataset>/."
  value       = module.storage.bucket_name
}

output "prompts_uri" {
  description = "s3:// URI of the prompts prefix."
  value       = module.storage.prompts_uri
}

output "outputs_uri" {
  description = "s3:// URI of the outputs prefix."
  value       = module.storage.outputs_uri
}

output "cluster_name" {
  description = "EKS cluster name."
  value       = module.cluster.cluster_name
}

output "kubeconfig_command" {
  description = "Command that points kubectl at the cluster."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.cluster_name}"
}

output "ray_role_arn" {
  description = "IAM role of the Ray pods (IRSA)."
  value       = module.identity.role_arn
}

output "namespace" {
  description = "Namespace of the specbatch jobs."
  value       = module.workflows.namespace
}

output "ray_service_account" {
  description = "Service account for the Ray pods of any specbatch RayJob or RayCluster."
  value       = module.workflows.ray_service_account
}

output "cron_jobs" {
  description = "CronJob of each scheduled workflow."
  value       = module.workflows.cron_jobs
}

output "output_uri_templates" {
  description = "Dated output prefix of each workflow (__RUN_DATE__ = the run's UTC date)."
  value       = module.workflows.output_uri_templates
}

output "rayjob_manifests" {
  description = "Generation RayJob of each workflow, for one-off runs."
  value       = module.workflows.rayjob_manifests
}

output "worker_sizing" {
  description = "Per workflow: what a GPU node gives a pod, and the worker pods' count and sizes."
  value       = module.workflows.worker_sizing

  precondition {
    condition     = alltrue([for w in module.workflows.worker_sizing : w.max_worker_pods <= var.gpu_max_nodes])
    error_message = "A run needs up to ${max([for w in module.workflows.worker_sizing : w.max_worker_pods]...)} GPU worker pods, one node each, but gpu_max_nodes is ${var.gpu_max_nodes}: raise gpu_max_nodes (and gpu_min_nodes without an autoscaler) or lower replicas and max_replicas."
  }
}

# Without a Cluster Autoscaler the pool never grows past gpu_min_nodes.
check "gpu_nodes_cover_a_run" {
  assert {
    condition     = alltrue([for w in module.workflows.worker_sizing : w.worker_pods <= var.gpu_min_nodes])
    error_message = "gpu_min_nodes (${var.gpu_min_nodes}) is below a run's GPU worker pods: runs wait for nodes unless a Cluster Autoscaler or Karpenter adds them."
  }
}
