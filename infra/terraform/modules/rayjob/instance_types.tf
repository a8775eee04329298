# What a pod can get on each supported node type, so that worker and head sizes follow the
# instance type and a plan whose pods cannot fit fails before anything is applied.
#
# Nominal vCPUs, memory and GPUs from the EC2 instance type pages; max_pods from EKS's
# ENI-based table (eni-max-pods.txt). To support another type, add a row here.
# Only NVIDIA types vLLM runs in bf16 (Ampere or newer): no g4dn (T4), no p3 (V100).

locals {
  gpu_instance_types = {
    "g5.xlarge"     = { vcpu = 4, memory_gib = 16, gpus = 1, max_pods = 58 }
    "g5.2xlarge"    = { vcpu = 8, memory_gib = 32, gpus = 1, max_pods = 58 }
    "g5.4xlarge"    = { vcpu = 16, memory_gib = 64, gpus = 1, max_pods = 234 }
    "g5.8xlarge"    = { vcpu = 32, memory_gib = 128, gpus = 1, max_pods = 234 }
    "g5.12xlarge"   = { vcpu = 48, memory_gib = 192, gpus = 4, max_pods = 737 }
    "g5.16xlarge"   = { vcpu = 64, memory_gib = 256, gpus = 1, max_pods = 234 }
    "g5.24xlarge"   = { vcpu = 96, memory_gib = 384, gpus = 4, max_pods = 737 }
    "g5.48xlarge"   = { vcpu = 192, memory_gib = 768, gpus = 8, max_pods = 345 }
    "g6.xlarge"     = { vcpu = 4, memory_gib = 16, gpus = 1, max_pods = 58 }
    "g6.2xlarge"    = { vcpu = 8, memory_gib = 32, gpus = 1, max_pods = 58 }
    "g6.4xlarge"    = { vcpu = 16, memory_gib = 64, gpus = 1, max_pods = 234 }
    "g6.8xlarge"    = { vcpu = 32, memory_gib = 128, gpus = 1, max_pods = 234 }
    "g6.12xlarge"   = { vcpu = 48, memory_gib = 192, gpus = 4, max_pods = 234 }
    "g6.16xlarge"   = { vcpu = 64, memory_gib = 256, gpus = 1, max_pods = 737 }
    "g6.24xlarge"   = { vcpu = 96, memory_gib = 384, gpus = 4, max_pods = 737 }
    "g6.48xlarge"   = { vcpu = 192, memory_gib = 768, gpus = 8, max_pods = 737 }
    "g6e.xlarge"    = { vcpu = 4, memory_gib = 32, gpus = 1, max_pods = 58 }
    "g6e.2xlarge"   = { vcpu = 8, memory_gib = 64, gpus = 1, max_pods = 58 }
    "g6e.4xlarge"   = { vcpu = 16, memory_gib = 128, gpus = 1, max_pods = 234 }
    "g6e.8xlarge"   = { vcpu = 32, memory_gib = 256, gpus = 1, max_pods = 234 }
    "g6e.12xlarge"  = { vcpu = 48, memory_gib = 384, gpus = 4, max_pods = 234 }
    "g6e.16xlarge"  = { vcpu = 64, memory_gib = 512, gpus = 1, max_pods = 737 }
    "g6e.24xlarge"  = { vcpu = 96, memory_gib = 768, gpus = 4, max_pods = 737 }
    "g6e.48xlarge"  = { vcpu = 192, memory_gib = 1536, gpus = 8, max_pods = 737 }
    "p4d.24xlarge"  = { vcpu = 96, memory_gib = 1152, gpus = 8, max_pods = 737 }
    "p4de.24xlarge" = { vcpu = 96, memory_gib = 1152, gpus = 8, max_pods = 737 }
    "p5.48xlarge"   = { vcpu = 192, memory_gib = 2048, gpus = 8, max_pods = 100 }
  }

  # The CPU node group (Ray heads, scheduler, operators).
  cpu_instance_types = {
    "m5.xlarge"   = { vcpu = 4, memory_gib = 16, gpus = 0, max_pods = 58 }
    "m5.2xlarge"  = { vcpu = 8, memory_gib = 32, gpus = 0, max_pods = 58 }
    "m5.4xlarge"  = { vcpu = 16, memory_gib = 64, gpus = 0, max_pods = 234 }
    "m6i.xlarge"  = { vcpu = 4, memory_gib = 16, gpus = 0, max_pods = 58 }
    "m6i.2xlarge" = { vcpu = 8, memory_gib = 32, gpus = 0, max_pods = 58 }
    "m6i.4xlarge" = { vcpu = 16, memory_gib = 64, gpus = 0, max_pods = 234 }
    "m6a.xlarge"  = { vcpu = 4, memory_gib = 16, gpus = 0, max_pods = 58 }
    "m6a.2xlarge" = { vcpu = 8, memory_gib = 32, gpus = 0, max_pods = 58 }
    "m6a.4xlarge" = { vcpu = 16, memory_gib = 64, gpus = 0, max_pods = 234 }
    "m7i.xlarge"  = { vcpu = 4, memory_gib = 16, gpus = 0, max_pods = 58 }
    "m7i.2xlarge" = { vcpu = 8, memory_gib = 32, gpus = 0, max_pods = 58 }
    "m7i.4xlarge" = { vcpu = 16, memory_gib = 64, gpus = 0, max_pods = 234 }
    "r6i.xlarge"  = { vcpu = 4, memory_gib = 32, gpus = 0, max_pods = 58 }
    "r6i.2xlarge" = { vcpu = 8, memory_gib = 64, gpus = 0, max_pods = 58 }
  }

  # What the kubelet leaves to pods on an EKS AL2023 node (nodeadm's defaults): kube-reserved
  # CPU is 6% of the first core, 1% of the second, 0.5% of the third and fourth and 0.25% of
  # each other; kube-reserved memory 255Mi + 11Mi per pod; hard eviction at 100Mi free.
  # The kernel reports about 94% of the nominal memory. DaemonSets (CNI, kube-proxy, device
  # plugin, CSI) take var.daemonset_reserve on top.
  allocatable = {
    for name, t in merge(local.gpu_instance_types, local.cpu_instance_types) : name => {
      cpu_m     = t.vcpu * 1000 - (60 + 10 + 5 * (min(t.vcpu, 4) - 2) + ceil(2.5 * max(0, t.vcpu - 4)))
      memory_mi = floor(t.memory_gib * 1024 * 0.94) - (255 + 11 * t.max_pods) - 100
      gpus      = t.gpus
    }
  }
}
