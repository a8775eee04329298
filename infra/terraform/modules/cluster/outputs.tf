output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = var.cluster_name
}

output "cluster_endpoint" {
  description = "URL of the Kubernetes API."
  value       = local.cluster_endpoint
}

output "cluster_ca_certificate" {
  description = "Base64-encoded CA certificate of the Kubernetes API."
  value       = local.cluster_ca
}

output "oidc_provider_arn" {
  description = "ARN of the IAM OIDC provider of the cluster (IRSA)."
  value       = var.create_cluster ? aws_iam_openid_connect_provider.this[0].arn : data.aws_iam_openid_connect_provider.existing[0].arn
}

output "oidc_issuer" {
  description = "OIDC issuer of the cluster without the https:// scheme."
  value       = replace(local.oidc_issuer_url, "https://", "")
}

output "gpu_node_selector" {
  description = "Node selector that places pods on the GPU node pool."
  value       = var.gpu_node_labels
}

output "system_node_selector" {
  description = "Node selector of the CPU node group (empty for an existing cluster)."
  value       = var.create_cluster ? { "specbatch.io/pool" = "system" } : {}
}

output "system_instance_types" {
  description = "Instance types of the CPU node group that runs the Ray heads (empty for an existing cluster)."
  value       = var.create_cluster ? var.system_instance_types : []
}
