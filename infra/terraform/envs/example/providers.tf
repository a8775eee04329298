provider "aws" {
  region = var.region
  default_tags {
    tags = var.tags
  }
}

# The Kubernetes and Helm providers talk to the cluster the cluster module made (or found).
# They get a fresh token from `aws eks get-token` whenever they need one: a token read once
# (aws_eks_cluster_auth) lasts 15 minutes, about as long as creating the cluster takes.
locals {
  eks_exec = {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.cluster.cluster_name, "--region", var.region, "--output", "json"]
  }
}

provider "kubernetes" {
  host                   = module.cluster.cluster_endpoint
  cluster_ca_certificate = base64decode(module.cluster.cluster_ca_certificate)
  exec {
    api_version = local.eks_exec.api_version
    command     = local.eks_exec.command
    args        = local.eks_exec.args
  }
}

provider "helm" {
  kubernetes = {
    host                   = module.cluster.cluster_endpoint
    cluster_ca_certificate = base64decode(module.cluster.cluster_ca_certificate)
    exec                   = local.eks_exec
  }
}
