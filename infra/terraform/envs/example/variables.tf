# --- Where ------------------------------------------------------------------------------------

variable "region" {
  description = "AWS region of the bucket and the cluster."
  type        = string
  default     = "us-east-1"
}

variable "tags" {
  description = "Tags added to every AWS resource."
  type        = map(string)
  default     = { project = "specbatch", environment = "example" }
}

# --- Object storage ---------------------------------------------------------------------------

variable "bucket_name" {
  description = "Globally unique name of the data bucket (prompts/ and outputs/)."
  type        = string
}

variable "access_log_bucket" {
  description = "Existing bucket that receives the data bucket's S3 server access logs."
  type        = string
}

variable "prompts_prefix" {
  description = "Key prefix of the prompt shards, e.g. prompts/ (one folder per dataset below it)."
  type        = string
  default     = "prompts/"
}

variable "outputs_prefix" {
  description = "Key prefix of the job outputs, e.g. outputs/ (DATASET/YYYY-MM-DD/ below it)."
  type        = string
  default     = "outputs/"
}

# --- Cluster ----------------------------------------------------------------------------------

variable "create_cluster" {
  description = "Create a new EKS cluster (true) or install into the existing cluster named cluster_name (false)."
  type        = bool
  default     = true
}

variable "cluster_name" {
  description = "Name of the EKS cluster to create or use."
  type        = string
  default     = "specbatch"
}

variable "kubernetes_version" {
  description = "Kubernetes version of a created cluster."
  type        = string
  default     = "1.33"
}

variable "subnet_ids" {
  description = "Private subnets in at least two availability zones (only when create_cluster is true)."
  type        = list(string)
  default     = []
}

variable "endpoint_public_access" {
  description = "Expose the Kubernetes API endpoint to public_access_cidrs (needed when terraform/kubectl run outside the VPC)."
  type        = bool
  default     = false
}

variable "public_access_cidrs" {
  description = "CIDRs allowed to reach a public API endpoint, e.g. your office's egress /32."
  type        = list(string)
  default     = []
}

variable "gpu_instance_types" {
  description = "GPU instance types (the accelerator type), e.g. [\"g6e.xlarge\"] (1x L40S) or [\"p4d.24xlarge\"] (8x A100 40GB)."
  type        = list(string)
  default     = ["g6e.xlarge"]
}

variable "gpu_accelerator" {
  description = "Accelerator name for node labels and cost reports; match the job config's resources.accelerator."
  type        = string
  default     = "nvidia-l40s"
}

variable "gpu_capacity_type" {
  description = "SPOT or ON_DEMAND GPU capacity."
  type        = string
  default     = "ON_DEMAND"

  validation {
    condition     = contains(["SPOT", "ON_DEMAND"], var.gpu_capacity_type)
    error_message = "gpu_capacity_type must be SPOT or ON_DEMAND."
  }
}

variable "gpu_min_nodes" {
  description = "GPU nodes kept running. Without a Cluster Autoscaler (not installed here) it must cover a run's worker pods (the worker_sizing output)."
  type        = number
  default     = 1
}

variable "gpu_max_nodes" {
  description = "Maximum number of GPU nodes."
  type        = number
  default     = 2
}

variable "gpus_per_node" {
  description = "GPUs per Ray worker pod. null: the replicas' GPUs up to a whole node of gpu_instance_types (1 on g6e.xlarge, up to 8 on p4d.24xlarge)."
  type        = number
  default     = null

  validation {
    condition     = var.gpus_per_node == null || try(contains([1, 2, 4, 8], var.gpus_per_node), false)
    error_message = "gpus_per_node must be null, 1, 2, 4 or 8."
  }
}

variable "worker_cpu" {
  description = "CPU of a Ray worker pod, e.g. \"30\". null (recommended): derived from gpu_instance_types; a value that does not fit fails the plan."
  type        = string
  default     = null
}

variable "worker_memory" {
  description = "Memory of a Ray worker pod, e.g. \"200Gi\" (includes its /dev/shm). null (recommended): derived from gpu_instance_types."
  type        = string
  default     = null
}

variable "shm_size" {
  description = "/dev/shm of a Ray worker pod. null: 30% of its memory."
  type        = string
  default     = null
}

variable "timeout_hours" {
  description = "Deadline of a generation run, pending pods included. A daily schedule allows at most 22 (the report and the next day's start need the rest)."
  type        = number
  default     = 20
}

variable "kuberay_version" {
  description = "KubeRay operator (Helm chart) version, 1.6.0 or later."
  type        = string
  default     = "1.6.0"
}

variable "install_nvidia_device_plugin" {
  description = "Install NVIDIA's device plugin (false if the cluster already runs it or the GPU Operator)."
  type        = bool
  default     = true
}

# --- Jobs ---------------------------------------------------------------------------------------

variable "namespace" {
  description = "Kubernetes namespace of the specbatch jobs."
  type        = string
  default     = "specbatch"
}

variable "image" {
  description = "The worker image built from infra/docker/Dockerfile and pushed to your registry, pinned by tag or digest."
  type        = string
}

variable "dataset" {
  description = "Dataset of the scheduled workflow: prompts are read from PROMPTS_PREFIX<dataset>/, outputs go to OUTPUTS_PREFIX<dataset>/<date>/."
  type        = string
  default     = "example"
}

variable "output" {
  description = "dated: each run regenerates the whole input into OUTPUTS_PREFIX<dataset>/<date>/; per_dataset: one location OUTPUTS_PREFIX<dataset>/, where each run generates only the input files no run generated before (and a run with none starts nothing)."
  type        = string
  default     = "dated"

  validation {
    condition     = contains(["dated", "per_dataset"], var.output)
    error_message = "output must be \"dated\" or \"per_dataset\"."
  }
}

variable "schedule" {
  description = "Cron schedule (UTC) of the dataset-generation workflow."
  type        = string
  default     = "0 2 * * *"
}

variable "replicas" {
  description = "Engine replicas of a run (one vLLM engine each); the minimum when max_replicas is larger."
  type        = number
  default     = 1
}

variable "max_replicas" {
  description = "Most engine replicas of a run: the Ray autoscaler adds GPU worker pods up to it while the job has work (the nodes come from gpu_max_nodes, through a Cluster Autoscaler or Karpenter). null: a fixed pool of replicas."
  type        = number
  default     = null
}

variable "tensor_parallel_size" {
  description = "GPUs per replica (vLLM tensor parallelism); at most gpus_per_node."
  type        = number
  default     = 1
}

variable "target_model_path" {
  description = "Path of the target model inside the pods (on the models volume)."
  type        = string
  default     = "/models/target"
}

variable "drafter_model_path" {
  description = "Path of the EAGLE-3.1 drafter inside the pods (on the models volume)."
  type        = string
  default     = "/models/drafter"
}

variable "models_claim_name" {
  description = "Existing ReadOnlyMany PersistentVolumeClaim (e.g. EFS or FSx for Lustre) with the model weights, mounted at /models. Empty when the weights are baked into the image."
  type        = string
  default     = ""
}
