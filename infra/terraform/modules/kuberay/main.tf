# The KubeRay operator (reconciles RayJob / RayCluster) and NVIDIA's device plugin.

resource "helm_release" "kuberay_operator" {
  name             = "kuberay-operator"
  repository       = var.kuberay_chart_repository
  chart            = "kuberay-operator"
  version          = var.kuberay_version
  namespace        = var.namespace
  create_namespace = true
  atomic           = true
  wait             = true
  timeout          = var.helm_timeout_seconds

  values = [yamlencode(merge(
    {
      nodeSelector = var.operator_node_selector
      resources = {
        requests = { cpu = "100m", memory = "256Mi" }
        limits   = { cpu = "1", memory = "1Gi" }
      }
    },
    length(var.watch_namespaces) > 0 ? { watchNamespace = var.watch_namespaces } : {},
  ))]
}

resource "helm_release" "nvidia_device_plugin" {
  count            = var.install_nvidia_device_plugin ? 1 : 0
  name             = "nvidia-device-plugin"
  repository       = var.nvidia_device_plugin_repository
  chart            = "nvidia-device-plugin"
  version          = var.nvidia_device_plugin_version
  namespace        = "nvidia-device-plugin"
  create_namespace = true
  atomic           = true
  timeout          = var.helm_timeout_seconds

  values = [yamlencode({
    tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  })]
}
