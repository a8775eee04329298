# Roles of the EKS control plane and of the nodes (AWS-managed policies only).

data "aws_iam_policy_document" "eks_assume" {
  statement {
    effect  = "Allow"
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    effect  = "Allow"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  count              = var.create_cluster ? 1 : 0
  name               = "${var.cluster_name}-eks-cluster"
  assume_role_policy = data.aws_iam_policy_document.eks_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "cluster" {
  count      = var.create_cluster ? 1 : 0
  role       = aws_iam_role.cluster[0].name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

# The control plane encrypts Kubernetes secrets with the cluster's KMS key.
data "aws_iam_policy_document" "cluster_encryption" {
  count = var.create_cluster ? 1 : 0
  statement {
    effect    = "Allow"
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ListGrants", "kms:DescribeKey"]
    resources = [aws_kms_key.eks[0].arn]
  }
}

resource "aws_iam_role_policy" "cluster_encryption" {
  count  = var.create_cluster ? 1 : 0
  name   = "secrets-encryption"
  role   = aws_iam_role.cluster[0].id
  policy = data.aws_iam_policy_document.cluster_encryption[0].json
}

resource "aws_iam_role" "node" {
  count              = var.create_cluster ? 1 : 0
  name               = "${var.cluster_name}-eks-node"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = var.create_cluster ? toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
  ]) : toset([])
  role       = aws_iam_role.node[0].name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}
