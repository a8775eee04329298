variable "workflow" {
  description = "Name of the workflow (a lower-case DNS label of at most 20 characters)."
  type        = string
}

variable "schedule" {
  description = "Cron schedule (UTC) of the workflow; a daily one must leave room for the next day's run."
  type        = string
  default     = ""
}

variable "namespace" {
  description = "Namespace of the RayJobs."
  type        = string
}

variable "image" {
  description = "Worker image (infra/docker/Dockerfile), pinned by tag or digest."
  type        = string
}

variable "ray_version" {
  description = "Ray version inside the image (the RayCluster's rayVersion)."
  type        = string
}

variable "service_account" {
  description = "Service account of the Ray pods (bound to the IRSA role)."
  type        = string
}

variable "aws_region" {
  description = "AWS region of the bucket; AWS_REGION in the Ray pods."
  type        = string
}

variable "dataset" {
  description = "Dataset name (SPECBATCH_DATASET in the job's environment)."
  type        = string
}

variable "output_uri" {
  description = "Output prefix of a run: dated, with __RUN_DATE__ where the run's date goes, or the data set's one prefix."
  type        = string
}

variable "job_config_uri" {
  description = "Where the job reads its config (the mounted file by default)."
  type        = string
  default     = "/etc/specbatch/job.yaml"
}

variable "job_config_map" {
  description = "ConfigMap holding job.yaml, mounted into the head at /etc/specbatch."
  type        = string
}

variable "job_config_yaml" {
  description = "The job config (YAML) the run reads, when the module's caller writes it (empty: not checked). Its resources.replicas must be what replicas and max_replicas say."
  type        = string
  default     = ""
}

variable "replicas" {
  description = "Engine replicas of a run: the whole pool, or its minimum when max_replicas is larger."
  type        = number
}

variable "max_replicas" {
  description = "Most engine replicas of an autoscaling pool (Ray Data's max_size; the Ray autoscaler adds worker pods up to it). null or equal to replicas: a fixed pool."
  type        = number
  default     = null
}

variable "autoscaler_idle_timeout_seconds" {
  description = "How long an autoscaling run's GPU worker pod may sit idle before the Ray autoscaler removes it; long enough to ride out a rebuild of the job's graph after a lost node."
  type        = number
  default     = 300

  validation {
    condition     = var.autoscaler_idle_timeout_seconds >= 30
    error_message = "autoscaler_idle_timeout_seconds must be at least 30."
  }
}

variable "gpus_per_replica" {
  description = "GPUs per replica (engine.tensor_parallel_size); a replica's GPUs are on one pod."
  type        = number
}

variable "gpus_per_worker" {
  description = "GPUs per Ray worker pod. null: as many as the replicas need, up to a whole node, in whole replicas."
  type        = number
  default     = null
}

variable "worker_cpu" {
  description = "CPU of a Ray worker pod, e.g. \"30\" or \"3500m\". null: the worker's share of the smallest GPU instance type's allocatable CPU."
  type        = string
  default     = null
}

variable "worker_memory" {
  description = "Memory of a Ray worker pod, e.g. \"48Gi\" (its /dev/shm counts against it). null: derived like worker_cpu."
  type        = string
  default     = null
}

variable "shm_size" {
  description = "Size of a worker's /dev/shm (Ray's object store, NCCL). null: 30% of the worker's memory."
  type        = string
  default     = null
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU node pool; every one of them must fit a worker pod."
  type        = list(string)
}

variable "head_instance_types" {
  description = "Instance types of the nodes of the Ray head pods; empty skips the head check (e.g. an existing cluster)."
  type        = list(string)
  default     = []
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

variable "head_node_selector" {
  description = "Node selector of the Ray head pods."
  type        = map(string)
  default     = {}
}

variable "gpu_node_selector" {
  description = "Node selector of the Ray GPU worker pods."
  type        = map(string)
  default     = {}
}

variable "daemonset_reserve" {
  description = "CPU and memory that DaemonSets request on every node, kept free of Ray pods."
  type        = object({ cpu = string, memory = string })
  default     = { cpu = "250m", memory = "512Mi" }
}

variable "timeout_hours" {
  description = "activeDeadlineSeconds of a generation RayJob, in hours, from its start (pending pods included)."
  type        = number
  default     = 20

  validation {
    condition     = var.timeout_hours > 0
    error_message = "timeout_hours must be positive."
  }
}

variable "pre_running_deadline_seconds" {
  description = "preRunningDeadlineSeconds: a RayJob whose cluster is not running by then fails (pods that cannot be scheduled, an image that cannot be pulled)."
  type        = number
  default     = 1800

  validation {
    condition     = var.pre_running_deadline_seconds >= 60
    error_message = "pre_running_deadline_seconds must be at least 60."
  }
}

variable "ttl_seconds_after_finished" {
  description = "Seconds the Ray cluster (GPU workers included) is kept after its job ends, to read its logs; then KubeRay deletes it."
  type        = number
  default     = 300

  validation {
    condition     = var.ttl_seconds_after_finished >= 0 && var.ttl_seconds_after_finished <= 3600
    error_message = "ttl_seconds_after_finished must be between 0 and 3600: a finished run's GPUs are released after it."
  }
}

variable "report_timeout_seconds" {
  description = "activeDeadlineSeconds of the cost-report RayJob."
  type        = number
  default     = 3600
}

variable "env" {
  description = "Extra environment of the Ray job (runtime_env env_vars); no credentials."
  type        = map(string)
  default     = {}
}

variable "extra_volumes" {
  description = "Extra pod volumes of the Ray pods (e.g. a read-only PVC with the model weights)."
  type        = list(any)
  default     = []
}

variable "extra_volume_mounts" {
  description = "Mounts of extra_volumes in the Ray containers."
  type        = list(any)
  default     = []
}
