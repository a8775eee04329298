# An EKS cluster with a CPU node group (Ray heads, operators) and a GPU node pool
# (Ray workers), plus the IAM OIDC provider for IRSA. With create_cluster = false the
# module only looks up an existing cluster and its OIDC provider.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]
}

resource "aws_kms_key" "eks" {
  count                   = var.create_cluster ? 1 : 0
  description             = "Secrets and control-plane log encryption of EKS cluster ${var.cluster_name}"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  is_enabled              = true

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdministersKeyThroughIam"
        Effect    = "Allow"
        Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "CloudWatchLogsEncryptsControlPlaneLogs"
        Effect    = "Allow"
        Principal = { Service = "logs.${data.aws_region.current.name}.amazonaws.com" }
        Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
        Condition = {
          ArnEquals = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${data.aws_partition.current.partition}:logs:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:log-group:/aws/eks/${var.cluster_name}/cluster"
          }
        }
      },
    ]
  })

  tags = var.tags
}

resource "aws_cloudwatch_log_group" "eks" {
  count             = var.create_cluster ? 1 : 0
  name              = "/aws/eks/${var.cluster_name}/cluster"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.eks[0].arn
  tags              = var.tags
}

resource "aws_eks_cluster" "this" {
  count    = var.create_cluster ? 1 : 0
  name     = var.cluster_name
  version  = var.kubernetes_version
  role_arn = aws_iam_role.cluster[0].arn

  enabled_cluster_log_types = local.log_types

  access_config {
    authentication_mode                         = "API_AND_CONFIG_MAP"
    bootstrap_cluster_creator_admin_permissions = true
  }

  vpc_config {
    subnet_ids              = var.subnet_ids
    endpoint_private_access = true
    endpoint_public_access  = var.endpoint_public_access
    public_access_cidrs     = var.public_access_cidrs
  }

  encryption_config {
    resources = ["secrets"]
    provider {
      key_arn = aws_kms_key.eks[0].arn
    }
  }

  tags = var.tags

  lifecycle {
    precondition {
      condition     = length(var.subnet_ids) >= 2
      error_message = "subnet_ids needs at least two subnets (in two availability zones) to create a cluster."
    }
    precondition {
      condition     = !var.endpoint_public_access || length(var.public_access_cidrs) > 0
      error_message = "A public endpoint needs explicit public_access_cidrs."
    }
  }

  depends_on = [
    aws_iam_role_policy_attachment.cluster,
    aws_iam_role_policy.cluster_encryption,
    aws_cloudwatch_log_group.eks,
  ]
}

data "aws_eks_cluster" "existing" {
  count = var.create_cluster ? 0 : 1
  name  = var.cluster_name
}

locals {
  cluster_endpoint = var.create_cluster ? aws_eks_cluster.this[0].endpoint : data.aws_eks_cluster.existing[0].endpoint
  cluster_ca       = var.create_cluster ? aws_eks_cluster.this[0].certificate_authority[0].data : data.aws_eks_cluster.existing[0].certificate_authority[0].data
  oidc_issuer_url  = var.create_cluster ? aws_eks_cluster.this[0].identity[0].oidc[0].issuer : data.aws_eks_cluster.existing[0].identity[0].oidc[0].issuer
}

# IRSA: the cluster's service-account tokens are trusted by IAM.
data "tls_certificate" "oidc" {
  count = var.create_cluster ? 1 : 0
  url   = local.oidc_issuer_url
}

resource "aws_iam_openid_connect_provider" "this" {
  count           = var.create_cluster ? 1 : 0
  url             = local.oidc_issuer_url
  client_id_list  = ["sts.amazonaws.com"]
  thumbprint_list = [data.tls_certificate.oidc[0].certificates[0].sha1_fingerprint]
  tags            = var.tags
}

data "aws_iam_openid_connect_provider" "existing" {
  count = var.create_cluster ? 0 : 1
  url   = local.oidc_issuer_url
}
