output "namespace" {
  description = "Namespace of the RayJobs and workflows."
  value       = local.namespace
}

output "ray_service_account" {
  description = "Service account of the Ray pods (bound to the IRSA role)."
  value       = kubernetes_service_account_v1.ray.metadata[0].name
}

output "cron_jobs" {
  description = "CronJob of each workflow."
  value       = { for name, cj in kubernetes_cron_job_v1.workflow : name => cj.metadata[0].name }
}

output "output_uri_templates" {
  description = "Dated output prefix of each workflow; __RUN_DATE__ becomes the run's UTC date (YYYY-MM-DD)."
  value       = { for name, w in local.workflows : name => w.output_uri }
}

output "rayjob_manifests" {
  description = "Generation RayJob of each workflow, for a one-off run: replace __RAYJOB_NAME__ and __RUN_DATE__, then kubectl create -f -."
  value       = { for name, r in module.rayjob : name => r.generate }
}

output "worker_sizing" {
  description = "Per workflow: what a GPU node gives a pod, and the worker pods' count and sizes."
  value       = { for name, r in module.rayjob : name => r.sizing }
}
