# CPU node group: Ray head pods, the KubeRay operator, the scheduler pods.
resource "aws_eks_node_group" "system" {
  count           = var.create_cluster ? 1 : 0
  cluster_name    = aws_eks_cluster.this[0].name
  node_group_name = "system"
  node_role_arn   = aws_iam_role.node[0].arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_STANDARD"
  capacity_type   = "ON_DEMAND"
  instance_types  = var.system_instance_types
  disk_size       = 100

  scaling_config {
    min_size     = var.system_min_nodes
    desired_size = max(var.system_min_nodes, 1)
    max_size     = var.system_max_nodes
  }

  labels = { "specbatch.io/pool" = "system" }
  tags   = var.tags

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# GPU node pool: Ray workers, one vLLM engine per replica. Tainted so that only pods
# that tolerate nvidia.com/gpu (the Ray GPU workers) land there.
resource "aws_eks_node_group" "gpu" {
  count           = var.create_cluster ? 1 : 0
  cluster_name    = aws_eks_cluster.this[0].name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node[0].arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_NVIDIA"
  capacity_type   = var.gpu_capacity_type
  instance_types  = var.gpu_instance_types
  disk_size       = var.gpu_node_disk_gib

  scaling_config {
    min_size     = var.gpu_min_nodes
    desired_size = var.gpu_min_nodes
    max_size     = var.gpu_max_nodes
  }

  # nvidia.com/gpu.present: the nvidia-device-plugin chart only runs on nodes labelled so
  # (or by Node Feature Discovery, which this cluster does not run).
  labels = merge(var.gpu_node_labels, {
    "specbatch.io/accelerator" = var.gpu_accelerator
    "nvidia.com/gpu.present"   = "true"
  })

  taint {
    key    = "nvidia.com/gpu"
    value  = "present"
    effect = "NO_SCHEDULE"
  }

  tags = var.tags

  lifecycle {
    # Left to the Cluster Autoscaler (the node group's auto-scaling group is tagged for auto-discovery by EKS).
    ignore_changes = [scaling_config[0].desired_size]
    precondition {
      condition     = var.gpu_min_nodes <= var.gpu_max_nodes
      error_message = "gpu_min_nodes must not exceed gpu_max_nodes."
    }
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}
