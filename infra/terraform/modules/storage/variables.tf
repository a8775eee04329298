variable "bucket_name" {
  description = "Name of the S3 bucket that holds prompts/ and outputs/ (globally unique)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name: 3-63 lower-case letters, digits, dots and hyphens."
  }
}

variable "prompts_prefix" {
  description = "Key prefix of the prompt shards (read by jobs). Ends with '/'."
  type        = string
  default     = "prompts/"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.prompts_prefix))
    error_message = "prompts_prefix must be a non-empty key prefix ending with '/', without wildcards."
  }
}

variable "outputs_prefix" {
  description = "Key prefix of job outputs (outputs/, errors/, stats/, _job.json, report/). Ends with '/'."
  type        = string
  default     = "outputs/"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.outputs_prefix))
    error_message = "outputs_prefix must be a non-empty key prefix ending with '/', without wildcards."
  }
}

variable "temporary_prefixes" {
  description = "Key prefixes of temporary data; objects under them expire after temporary_expiration_days."
  type        = list(string)
  default     = ["tmp/", "outputs/_tmp/"]

  validation {
    condition     = alltrue([for p in var.temporary_prefixes : can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", p))])
    error_message = "Each temporary prefix must be a non-empty key prefix ending with '/'."
  }
}

variable "temporary_expiration_days" {
  description = "Days after which objects under temporary_prefixes are deleted."
  type        = number
  default     = 7

  validation {
    condition     = var.temporary_expiration_days >= 1
    error_message = "temporary_expiration_days must be at least 1."
  }
}

variable "abort_incomplete_upload_days" {
  description = "Days after which incomplete multipart uploads (partial objects of interrupted jobs) are aborted."
  type        = number
  default     = 2

  validation {
    condition     = var.abort_incomplete_upload_days >= 1
    error_message = "abort_incomplete_upload_days must be at least 1."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Days a replaced or deleted object version is kept (versioning is on) before it is deleted."
  type        = number
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "access_log_bucket" {
  description = "Existing bucket that receives S3 server access logs of this bucket."
  type        = string
}

variable "kms_deletion_window_days" {
  description = "Waiting period before the bucket's KMS key is deleted after destroy."
  type        = number
  default     = 30

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30
    error_message = "kms_deletion_window_days must be between 7 and 30."
  }
}

variable "force_destroy" {
  description = "Allow terraform destroy to delete a non-empty bucket. Keep false outside throw-away environments."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
