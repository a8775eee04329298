variable "namespace" {
  description = "Namespace of the specbatch RayJobs, their service accounts and the scheduled workflows."
  type        = string
  default     = "specbatch"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace)) && var.namespace != "default"
    error_message = "namespace must be a DNS-1123 label and not 'default'."
  }
}

variable "create_namespace" {
  description = "Create the namespace (false when it already exists)."
  type        = bool
  default     = true
}

variable "image" {
  description = "Worker image (infra/docker/Dockerfile), preferably pinned by digest: REGISTRY/specbatch@sha256:..."
  type        = string

  validation {
    condition     = can(regex("^[^\\s]+(:[A-Za-z0-9_.-]+|@sha256:[a-f0-9]{64})$", var.image)) && !endswith(var.image, ":latest")
    error_message = "image must carry an explicit tag (not latest) or a sha256 digest."
  }
}

variable "ray_version" {
  description = "Ray version inside the image (the RayCluster's rayVersion)."
  type        = string
  default     = "2.60.0"
}

variable "service_account" {
  description = "Name of the Kubernetes service account of the Ray pods (must match the IRSA role's trust policy)."
  type        = string
  default     = "specbatch-ray"
}

variable "ray_role_arn" {
  description = "ARN of the IAM role the Ray pods assume through IRSA (identity module)."
  type        = string
}

variable "aws_region" {
  description = "AWS region of the bucket; set as AWS_REGION in the Ray pods."
  type        = string
}

variable "bucket_name" {
  description = "Bucket that holds prompts/ and outputs/."
  type        = string
}

variable "outputs_prefix" {
  description = "Key prefix under which each workflow writes DATASET/YYYY-MM-DD/. Ends with '/'."
  type        = string
  default     = "outputs/"

  validation {
    condition     = endswith(var.outputs_prefix, "/") && !strcontains(var.outputs_prefix, "*")
    error_message = "outputs_prefix must end with '/' and contain no wildcard."
  }
}

variable "head_node_selector" {
  description = "Node selector of Ray head pods and scheduler pods (the CPU node group)."
  type        = map(string)
  default     = {}
}

variable "gpu_node_selector" {
  description = "Node selector of Ray GPU worker pods (the GPU node pool)."
  type        = map(string)
  default     = {}
}

variable "head_cpu" {
  description = "CPU of a generation run's Ray head pod (runs the driver; no Ray tasks)."
  type        = string
  default     = "4"
}

variable "head_memory" {
  description = "Memory of a generation run's Ray head pod."
  type        = string
  default     = "16Gi"
}

variable "extra_volumes" {
  description = "Extra pod volumes of the Ray pods, e.g. a read-only PVC with model weights (the job config's model.path points there)."
  type        = list(any)
  default     = []
}

variable "extra_volume_mounts" {
  description = "Mounts of extra_volumes in the Ray containers, e.g. [{ name = \"models\", mountPath = \"/models\", readOnly = true }]."
  type        = list(any)
  default     = []
}

variable "scheduler_image" {
  description = "Image of the scheduler pods that create the RayJobs: needs sh, sed, awk, kubectl, and aws and jq for the _job.json check. Pin by tag or digest."
  type        = string
  default     = "docker.io/alpine/k8s:1.33.4"

  validation {
    condition     = !endswith(var.scheduler_image, ":latest") && can(regex("(:[A-Za-z0-9_.-]+|@sha256:[a-f0-9]{64})$", var.scheduler_image))
    error_message = "scheduler_image must carry an explicit tag (not latest) or a sha256 digest."
  }
}

variable "workflows" {
  description = <<-EOT
    Scheduled dataset-generation workflows, by name (a lower-case DNS label of at most 20 characters).
    Each run writes s3://BUCKET/OUTPUTS_PREFIX/<dataset>/<YYYY-MM-DD>/ and then a cost report under it;
    with output = "per_dataset", every run writes s3://BUCKET/OUTPUTS_PREFIX/<dataset>/ and generates only
    the input files no run there generated before (a run with none starts nothing).
      schedule            cron expression (UTC), e.g. "0 2 * * *"
      dataset             dataset name, the first path element under outputs_prefix
      output              "dated" (default): a full generation per run date; "per_dataset": one location, new files only
      job_config_yaml     the job config (YAML), mounted at /etc/specbatch/job.yaml; its output_uri is replaced by the dated prefix
      job_config_uri      where the job reads its config; defaults to the mounted file (an s3:// URI must be under a prefix the role can read)
      replicas            engine replicas (resources.replicas of the job config); the minimum when max_replicas is larger
      max_replicas        most engine replicas: the Ray autoscaler adds GPU worker pods up to it, and the job
                          config's resources.replicas must then be {min: replicas, max: max_replicas} (the plan checks it)
      gpus_per_replica    GPUs per replica (resources.gpus_per_replica = engine.tensor_parallel_size)
      gpus_per_worker     GPUs per Ray worker pod; unset: the replicas' GPUs up to a whole node
      worker_cpu/memory   CPU and memory of a Ray worker pod, shm_size its /dev/shm; unset: derived
                          from gpu_instance_types (modules/rayjob/instance_types.tf), and checked when set
      timeout_hours       deadline of one generation RayJob, from its creation
      pre_running_deadline_minutes
                          a RayJob whose pods are not running by then fails (unschedulable, image pull)
      suspend             pause the schedule
      env                 extra environment variables of the Ray job (runtime_env env_vars); no credentials
    Runs of one workflow never overlap: the CronJob's concurrencyPolicy is Forbid.
  EOT
  type = map(object({
    schedule                     = string
    dataset                      = string
    output                       = optional(string, "dated")
    job_config_yaml              = optional(string, "")
    job_config_uri               = optional(string, "/etc/specbatch/job.yaml")
    replicas                     = optional(number, 1)
    max_replicas                 = optional(number)
    gpus_per_replica             = optional(number, 1)
    gpus_per_worker              = optional(number)
    worker_cpu                   = optional(string)
    worker_memory                = optional(string)
    shm_size                     = optional(string)
    timeout_hours                = optional(number, 20)
    pre_running_deadline_minutes = optional(number, 30)
    suspend                      = optional(bool, false)
    env                          = optional(map(string), {})
  }))
  default = {}

  validation {
    condition     = alltrue([for name, w in var.workflows : can(regex("^[a-z]([-a-z0-9]{0,18}[a-z0-9])?$", name))])
    error_message = "Workflow names must be lower-case DNS labels of at most 20 characters, starting with a letter."
  }

  validation {
    condition     = alltrue([for w in var.workflows : length(split(" ", trimspace(w.schedule))) == 5 || startswith(w.schedule, "@")])
    error_message = "schedule must be a five-field cron expression or a macro such as @daily."
  }

  validation {
    condition     = alltrue([for w in var.workflows : contains(["dated", "per_dataset"], w.output)])
    error_message = "output must be \"dated\" (a full generation per run date) or \"per_dataset\" (one location, new input files only)."
  }

  validation {
    condition     = alltrue([for w in var.workflows : can(regex("^[A-Za-z0-9_.-]+$", w.dataset))])
    error_message = "dataset must be a single path element: letters, digits, '_', '.', '-'."
  }

  validation {
    condition = alltrue([for w in var.workflows :
      w.replicas >= 1 && w.gpus_per_replica >= 1 && floor(w.gpus_per_replica) == w.gpus_per_replica &&
      (w.gpus_per_worker == null || try(w.gpus_per_worker >= w.gpus_per_replica && w.gpus_per_worker % w.gpus_per_replica == 0, false))
    ])
    error_message = "Each workflow needs replicas >= 1 and whole gpus_per_replica >= 1 dividing gpus_per_worker (a replica's GPUs are on one pod)."
  }

  validation {
    condition     = alltrue([for w in var.workflows : w.max_replicas == null || try(w.max_replicas >= w.replicas, false)])
    error_message = "workflow ${join(", ", [for name, w in var.workflows : name if !(w.max_replicas == null || try(w.max_replicas >= w.replicas, false))])}: max_replicas must be at least replicas (the pool's minimum), or unset for a fixed pool."
  }

  validation {
    condition     = alltrue([for w in var.workflows : w.pre_running_deadline_minutes >= 1 && w.pre_running_deadline_minutes * 60 < w.timeout_hours * 3600])
    error_message = "pre_running_deadline_minutes must be at least 1 and shorter than timeout_hours."
  }

  validation {
    condition     = alltrue([for w in var.workflows : w.job_config_yaml != "" || w.job_config_uri != "/etc/specbatch/job.yaml"])
    error_message = "Each workflow needs job_config_yaml, or a job_config_uri other than the mounted default."
  }

  validation {
    condition = alltrue([for w in var.workflows : alltrue([for k in keys(w.env) :
      !can(regex("(?i)(SECRET|PASSWORD|TOKEN|ACCESS_KEY)", k))
    ])])
    error_message = "env must not carry credentials: the Ray pods get theirs from IRSA."
  }
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU node pool (the cluster module's gpu_instance_types); worker pods are sized to fit the smallest."
  type        = list(string)
  default     = ["g6e.xlarge"]
}

variable "head_instance_types" {
  description = "Instance types of the nodes that run the Ray heads (the cluster module's system_instance_types); empty skips the head size check."
  type        = list(string)
  default     = []
}

variable "ttl_seconds_after_finished" {
  description = "Seconds a finished run's Ray cluster (GPU workers included) is kept to read its logs before KubeRay deletes it."
  type        = number
  default     = 300
}

variable "report_timeout_seconds" {
  description = "Deadline of a cost-report RayJob."
  type        = number
  default     = 3600
}

variable "keep_runs" {
  description = "RayJobs of the last keep_runs run dates of a workflow are kept (status, submitter logs); finished older ones are deleted at each run."
  type        = number
  default     = 14

  validation {
    condition     = var.keep_runs >= 1
    error_message = "keep_runs must be at least 1."
  }
}

variable "scheduler_service_account" {
  description = "Name of the scheduler pods' service account."
  type        = string
  default     = "specbatch-scheduler"
}

variable "scheduler_role_arn" {
  description = "IAM role (IRSA) of the scheduler pods that may read the outputs' _job.json, so that a rerun of a finished date starts no GPUs. Empty: no check, every run creates its RayJob."
  type        = string
  default     = ""
}

variable "labels" {
  description = "Labels added to every Kubernetes object."
  type        = map(string)
  default     = {}
}
