# The scheduler: a CronJob per workflow whose pod creates the run's RayJobs and waits for
# them, with a service account that may only create, read and delete RayJobs in this
# namespace and, through IRSA when scheduler_role_arn is set, read the outputs' _job.json.

resource "kubernetes_service_account_v1" "scheduler" {
  metadata {
    name        = var.scheduler_service_account
    namespace   = local.namespace
    labels      = local.labels
    annotations = var.scheduler_role_arn == "" ? {} : { "eks.amazonaws.com/role-arn" = var.scheduler_role_arn }
  }
  automount_service_account_token = false
}

resource "kubernetes_role_v1" "scheduler" {
  metadata {
    name      = "specbatch-scheduler"
    namespace = local.namespace
    labels    = local.labels
  }
  rule {
    api_groups = ["ray.io"]
    resources  = ["rayjobs"]
    verbs      = ["create", "get", "list", "watch", "delete"] # delete: cleanup of old runs' RayJobs
  }
}

resource "kubernetes_role_binding_v1" "scheduler" {
  metadata {
    name      = "specbatch-scheduler"
    namespace = local.namespace
    labels    = local.labels
  }
  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.scheduler.metadata[0].name
  }
  subject {
    kind      = "ServiceAccount"
    name      = kubernetes_service_account_v1.scheduler.metadata[0].name
    namespace = local.namespace
  }
}

resource "kubernetes_cron_job_v1" "workflow" {
  for_each = local.workflows

  metadata {
    name      = "specbatch-${each.key}"
    namespace = local.namespace
    labels    = merge(local.labels, { "specbatch.io/workflow" = each.key })
  }

  spec {
    schedule                      = each.value.schedule
    concurrency_policy            = "Forbid" # Replace would kill the scheduler pod and leave its RayJob running
    starting_deadline_seconds     = 3600
    successful_jobs_history_limit = 3
    failed_jobs_history_limit     = 5
    suspend                       = each.value.suspend

    job_template {
      metadata {
        labels = merge(local.labels, { "specbatch.io/workflow" = each.key })
      }
      spec {
        # A failed run is not retried blindly: re-running the same dated prefix resumes it.
        backoff_limit              = 0
        active_deadline_seconds    = module.rayjob[each.key].scheduler_seconds
        ttl_seconds_after_finished = 7 * 24 * 3600

        template {
          metadata {
            labels = merge(local.labels, { "specbatch.io/workflow" = each.key, "app.kubernetes.io/component" = "scheduler" })
          }
          spec {
            service_account_name            = kubernetes_service_account_v1.scheduler.metadata[0].name
            automount_service_account_token = true # kubectl talks to the API as the scheduler account
            restart_policy                  = "Never"
            node_selector                   = var.head_node_selector

            security_context {
              run_as_non_root = true
              run_as_user     = 65532
              run_as_group    = 65532
              seccomp_profile {
                type = "RuntimeDefault"
              }
            }

            container {
              name              = "scheduler"
              image             = var.scheduler_image
              image_pull_policy = "Always"
              command           = ["/bin/sh", "/etc/specbatch-workflow/run.sh"]

              env {
                name  = "WORKFLOW"
                value = each.key
              }
              env {
                name  = "NAMESPACE"
                value = local.namespace
              }
              env {
                name  = "OUTPUT_URI"
                value = each.value.output_uri
              }
              env {
                name  = "OUTPUT_MODE"
                value = each.value.output
              }
              env {
                name  = "KEEP_RUNS"
                value = tostring(var.keep_runs)
              }
              env {
                name  = "AWS_REGION"
                value = var.aws_region
              }
              env {
                name  = "HOME"
                value = "/tmp"
              }

              resources {
                requests = { cpu = "50m", memory = "64Mi" }
                limits   = { cpu = "200m", memory = "256Mi" }
              }

              security_context {
                allow_privilege_escalation = false
                privileged                 = false
                read_only_root_filesystem  = true
                run_as_non_root            = true
                capabilities {
                  drop = ["ALL"]
                }
              }

              volume_mount {
                name       = "workflow"
                mount_path = "/etc/specbatch-workflow"
                read_only  = true
              }
              volume_mount {
                name       = "tmp"
                mount_path = "/tmp"
              }
            }

            volume {
              name = "workflow"
              config_map {
                name = kubernetes_config_map_v1.scheduler[each.key].metadata[0].name
              }
            }
            volume {
              name = "tmp"
              empty_dir {
                size_limit = "64Mi"
              }
            }
          }
        }
      }
    }
  }

  depends_on = [kubernetes_role_binding_v1.scheduler]
}
