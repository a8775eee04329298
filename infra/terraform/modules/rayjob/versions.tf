# No provider: `terraform plan` of this module runs anywhere, offline, without a cluster.
terraform {
  required_version = ">= 1.6"
}
