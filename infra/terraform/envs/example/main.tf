# Example environment: bucket, GPU EKS cluster (or an existing one) with KubeRay, the Ray
# pods' IRSA role, and one daily dataset-generation workflow with its cost report.

locals {
  ray_service_account       = "specbatch-ray"
  scheduler_service_account = "specbatch-scheduler"

  models_volumes = var.models_claim_name == "" ? [] : [{
    name                  = "models"
    persistentVolumeClaim = { claimName = var.models_claim_name, readOnly = true }
  }]
  models_mounts = var.models_claim_name == "" ? [] : [{ name = "models", mountPath = "/models", readOnly = true }]

  # resources.replicas of the job config: the same pool as the worker group (modules/rayjob
  # refuses a job config that says otherwise).
  job_config_replicas = var.max_replicas == null || var.max_replicas == var.replicas ? tostring(var.replicas) : "{min: ${var.replicas}, max: ${var.max_replicas}}"
}

module "storage" {
  source = "../../modules/storage"

  bucket_name       = var.bucket_name
  access_log_bucket = var.access_log_bucket
  prompts_prefix    = var.prompts_prefix
  outputs_prefix    = var.outputs_prefix
  tags              = var.tags
}

module "cluster" {
  source = "../../modules/cluster"

  create_cluster         = var.create_cluster
  cluster_name           = var.cluster_name
  kubernetes_version     = var.kubernetes_version
  subnet_ids             = var.subnet_ids
  endpoint_public_access = var.endpoint_public_access
  public_access_cidrs    = var.public_access_cidrs
  gpu_instance_types     = var.gpu_instance_types
  gpu_accelerator        = var.gpu_accelerator
  gpu_capacity_type      = var.gpu_capacity_type
  gpu_min_nodes          = var.gpu_min_nodes
  gpu_max_nodes          = var.gpu_max_nodes
  tags                   = var.tags
}

module "identity" {
  source = "../../modules/identity"

  name              = "${var.cluster_name}-specbatch-ray"
  oidc_provider_arn = module.cluster.oidc_provider_arn
  oidc_issuer       = module.cluster.oidc_issuer
  namespace         = var.namespace
  service_account   = local.ray_service_account
  bucket_arn        = module.storage.bucket_arn
  kms_key_arn       = module.storage.kms_key_arn
  region            = var.region
  prompts_prefix    = var.prompts_prefix
  outputs_prefix    = var.outputs_prefix
  tags              = var.tags

  scheduler_service_account = local.scheduler_service_account
}

module "kuberay" {
  source = "../../modules/kuberay"

  kuberay_version              = var.kuberay_version
  install_nvidia_device_plugin = var.install_nvidia_device_plugin
  operator_node_selector       = module.cluster.system_node_selector

  # Helm waits (atomic) for the operator pod: on a new cluster, only once the nodes exist.
  depends_on = [module.cluster]
}

module "workflows" {
  source = "../../modules/workflows"

  namespace           = var.namespace
  image               = var.image
  service_account     = local.ray_service_account
  ray_role_arn        = module.identity.role_arn
  aws_region          = var.region
  bucket_name         = module.storage.bucket_name
  outputs_prefix      = var.outputs_prefix
  head_node_selector  = module.cluster.system_node_selector
  gpu_node_selector   = module.cluster.gpu_node_selector
  extra_volumes       = local.models_volumes
  extra_volume_mounts = local.models_mounts
  gpu_instance_types  = var.gpu_instance_types
  head_instance_types = module.cluster.system_instance_types

  scheduler_service_account = local.scheduler_service_account
  scheduler_role_arn        = module.identity.scheduler_role_arn

  workflows = {
    daily = {
      schedule         = var.schedule
      dataset          = var.dataset
      output           = var.output
      replicas         = var.replicas
      max_replicas     = var.max_replicas
      gpus_per_replica = var.tensor_parallel_size
      gpus_per_worker  = var.gpus_per_node
      worker_cpu       = var.worker_cpu
      worker_memory    = var.worker_memory
      shm_size         = var.shm_size
      timeout_hours    = var.timeout_hours
      job_config_yaml = templatefile("${path.module}/job-config.yaml", {
        job_name             = "${var.dataset}-daily"
        input_uri            = "${module.storage.prompts_uri}${var.dataset}/"
        output_uri           = "${module.storage.outputs_uri}${var.dataset}/unscheduled/"
        target_model_path    = var.target_model_path
        drafter_model_path   = var.drafter_model_path
        tensor_parallel_size = var.tensor_parallel_size
        replicas             = local.job_config_replicas
        accelerator          = var.gpu_accelerator
        region               = var.region
      })
    }
  }

  depends_on = [module.kuberay]
}
