output "operator_namespace" {
  description = "Namespace of the KubeRay operator."
  value       = helm_release.kuberay_operator.namespace
}

output "kuberay_version" {
  description = "Installed KubeRay version."
  value       = helm_release.kuberay_operator.version
}
