variable "namespace" {
  description = "Namespace of the KubeRay operator."
  type        = string
  default     = "kuberay-system"
}

variable "kuberay_version" {
  description = "Version of the kuberay-operator Helm chart (and of the operator). The RayJobs use backoffLimit (KubeRay 1.2) and preRunningDeadlineSeconds (1.6), so 1.6.0 or later. Helm installs the CRDs only once: on a cluster that had an older KubeRay, replace them too (docs/infra.md)."
  type        = string
  default     = "1.6.0"

  validation {
    condition     = can(regex("^1\\.([6-9]|[1-9][0-9])\\.[0-9]+$", var.kuberay_version))
    error_message = "kuberay_version must be a released version 1.6.0 or later (e.g. 1.6.0): older RayJob CRDs have no preRunningDeadlineSeconds (1.6) or backoffLimit (1.2), and the API server would drop them."
  }
}

variable "kuberay_chart_repository" {
  description = "Helm repository of the kuberay-operator chart (a mirror may be used)."
  type        = string
  default     = "https://ray-project.github.io/kuberay-helm/"
}

variable "watch_namespaces" {
  description = "Namespaces the operator watches for RayJobs; empty means all namespaces."
  type        = list(string)
  default     = []
}

variable "install_nvidia_device_plugin" {
  description = "Install NVIDIA's device plugin so nodes advertise nvidia.com/gpu. Set false when the cluster already runs it (or the GPU Operator)."
  type        = bool
  default     = true
}

variable "nvidia_device_plugin_version" {
  description = "Version of the nvidia-device-plugin Helm chart."
  type        = string
  default     = "0.17.1"
}

variable "nvidia_device_plugin_repository" {
  description = "Helm repository of the nvidia-device-plugin chart."
  type        = string
  default     = "https://nvidia.github.io/k8s-device-plugin"
}

variable "helm_timeout_seconds" {
  description = "How long Helm waits for the operator and device plugin to be ready (a new cluster's nodes join first)."
  type        = number
  default     = 900
}

variable "operator_node_selector" {
  description = "Node selector of the operator pod (the CPU node group)."
  type        = map(string)
  default     = {}
}
