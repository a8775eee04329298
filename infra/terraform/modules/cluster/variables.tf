variable "create_cluster" {
  description = "Create an EKS cluster (true) or use the existing cluster named cluster_name (false)."
  type        = bool
  default     = true
}

variable "cluster_name" {
  description = "Name of the EKS cluster to create, or of the existing cluster when create_cluster is false."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$", var.cluster_name))
    error_message = "cluster_name must be 1-100 letters, digits, hyphens and underscores, starting with a letter or digit."
  }
}

variable "kubernetes_version" {
  description = "Kubernetes version of a created cluster."
  type        = string
  default     = "1.33"

  validation {
    condition     = can(regex("^1\\.[0-9]{2}$", var.kubernetes_version))
    error_message = "kubernetes_version must look like 1.33."
  }
}

variable "subnet_ids" {
  description = "Private subnets (at least two availability zones) for the control plane and the node groups. Required when create_cluster is true."
  type        = list(string)
  default     = []
}

variable "endpoint_public_access" {
  description = "Expose the Kubernetes API endpoint publicly (restricted to public_access_cidrs). Keep false when terraform and kubectl run inside the VPC."
  type        = bool
  default     = false
}

variable "public_access_cidrs" {
  description = "CIDR blocks allowed to reach a public API endpoint; never 0.0.0.0/0."
  type        = list(string)
  default     = []

  validation {
    condition     = !contains(var.public_access_cidrs, "0.0.0.0/0")
    error_message = "public_access_cidrs must not contain 0.0.0.0/0."
  }
}

variable "log_retention_days" {
  description = "Retention of the control-plane logs in CloudWatch."
  type        = number
  default     = 365

  validation {
    condition     = contains([365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a CloudWatch retention of at least one year (365, 400, 545, 731, ...)."
  }
}

variable "system_instance_types" {
  description = "Instance types of the CPU node group that runs the Ray head pods and the operators."
  type        = list(string)
  default     = ["m6i.2xlarge"]
}

variable "system_min_nodes" {
  description = "Minimum size of the CPU node group."
  type        = number
  default     = 1
}

variable "system_max_nodes" {
  description = "Maximum size of the CPU node group."
  type        = number
  default     = 3

  validation {
    condition     = var.system_max_nodes >= 1
    error_message = "system_max_nodes must be at least 1."
  }
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU node pool; they set the accelerator (e.g. g6e.xlarge = 1x L40S, p4d.24xlarge = 8x A100)."
  type        = list(string)
  default     = ["g6e.xlarge"]

  validation {
    condition     = length(var.gpu_instance_types) > 0 && alltrue([for t in var.gpu_instance_types : can(regex("^(g[4-9]|p[3-6]|gr6)[a-z0-9-]*\\.[a-z0-9]+$", t))])
    error_message = "gpu_instance_types must be NVIDIA GPU instance types (g4dn, g5, g6, g6e, p4d, p5, ...)."
  }
}

variable "gpu_accelerator" {
  description = "Accelerator name written to the GPU nodes' label specbatch.io/accelerator (use the same value as the job config's resources.accelerator, e.g. nvidia-l40s)."
  type        = string
  default     = "nvidia-l40s"
}

variable "gpu_capacity_type" {
  description = "SPOT or ON_DEMAND capacity for the GPU node pool. Jobs are resumable, so SPOT interruptions cost only the lost batches."
  type        = string
  default     = "ON_DEMAND"

  validation {
    condition     = contains(["SPOT", "ON_DEMAND"], var.gpu_capacity_type)
    error_message = "gpu_capacity_type must be SPOT or ON_DEMAND."
  }
}

variable "gpu_min_nodes" {
  description = "Minimum (and initial) number of GPU nodes. Nodes beyond it are only added by a Cluster Autoscaler or Karpenter, which this module does not install; 0 suits a cluster that runs one."
  type        = number
  default     = 0

  validation {
    condition     = var.gpu_min_nodes >= 0
    error_message = "gpu_min_nodes must be 0 or more."
  }
}

variable "gpu_max_nodes" {
  description = "Maximum number of GPU nodes."
  type        = number
  default     = 4

  validation {
    condition     = var.gpu_max_nodes >= 1
    error_message = "gpu_max_nodes must be at least 1."
  }
}

variable "gpu_node_disk_gib" {
  description = "Root volume size of GPU nodes (the image with CUDA and vLLM, and model weights, live there)."
  type        = number
  default     = 300
}

variable "gpu_node_labels" {
  description = "Labels of the GPU nodes; the RayJob workers select nodes with them."
  type        = map(string)
  default     = { "specbatch.io/pool" = "gpu" }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
