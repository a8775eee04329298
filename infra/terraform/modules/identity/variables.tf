variable "name" {
  description = "Name of the IAM role (and of its policy) that the Ray pods assume."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9+=,.@_-]{1,54}$", var.name))
    error_message = "name must be 1-54 IAM role name characters (the scheduler's role adds -scheduler)."
  }
}

variable "oidc_provider_arn" {
  description = "ARN of the cluster's IAM OIDC provider (IRSA)."
  type        = string
}

variable "oidc_issuer" {
  description = "The cluster's OIDC issuer without the scheme, e.g. oidc.eks.eu-west-1.amazonaws.com/id/ABC123."
  type        = string

  validation {
    condition     = !startswith(var.oidc_issuer, "https://")
    error_message = "oidc_issuer must not include the https:// scheme."
  }
}

variable "namespace" {
  description = "Kubernetes namespace of the Ray pods' service account."
  type        = string
}

variable "service_account" {
  description = "Kubernetes service account of the Ray head and worker pods; the only subject allowed to assume the role."
  type        = string
}

variable "scheduler_service_account" {
  description = "Kubernetes service account of the scheduler pods, given a role that reads the outputs' _job.json and nothing else. Empty: no such role."
  type        = string
  default     = ""
}

variable "bucket_arn" {
  description = "ARN of the data bucket."
  type        = string
}

variable "kms_key_arn" {
  description = "ARN of the bucket's KMS key; usable only through S3 in this region."
  type        = string
}

variable "region" {
  description = "AWS region of the bucket (restricts KMS use to s3.<region>.amazonaws.com)."
  type        = string
}

variable "prompts_prefix" {
  description = "Key prefix the role may read (prompt shards). Ends with '/'."
  type        = string
  default     = "prompts/"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.prompts_prefix))
    error_message = "prompts_prefix must be a non-empty key prefix ending with '/', without wildcards."
  }
}

variable "outputs_prefix" {
  description = "Key prefix the role may read and write (job outputs and reports). Ends with '/'."
  type        = string
  default     = "outputs/"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.outputs_prefix))
    error_message = "outputs_prefix must be a non-empty key prefix ending with '/', without wildcards."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
