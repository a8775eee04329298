# IRSA: an IAM role that only the Ray pods' Kubernetes service account can assume,
# allowed to read the prompts prefix and to read and write the outputs prefix. Nothing else.
# Optionally a second role for the scheduler pods: read the outputs' _job.json only.

data "aws_iam_policy_document" "trust" {
  statement {
    sid     = "RayPodsServiceAccount"
    effect  = "Allow"
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${var.service_account}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "data_access" {
  # Listing is limited to keys under the two prefixes.
  statement {
    sid       = "ListPrompts"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [var.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.prompts_prefix, "${var.prompts_prefix}*"]
    }
  }

  statement {
    sid       = "ListOutputs"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [var.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.outputs_prefix, "${var.outputs_prefix}*"]
    }
  }

  statement {
    sid       = "ReadPrompts"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = ["${var.bucket_arn}/${var.prompts_prefix}*"]
  }

  # DeleteObject lets writers replace their own partial files; with versioning on it only
  # adds a delete marker (DeleteObjectVersion is not granted, so history stays).
  statement {
    sid    = "ReadWriteOutputs"
    effect = "Allow"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${var.bucket_arn}/${var.outputs_prefix}*"]
  }

  # SSE-KMS: objects can only be read and written with the bucket's key, and only via S3.
  statement {
    sid       = "BucketKeyViaS3"
    effect    = "Allow"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "ray" {
  name                 = var.name
  description          = "Assumed by the specbatch Ray pods (${var.namespace}/${var.service_account}) through IRSA."
  assume_role_policy   = data.aws_iam_policy_document.trust.json
  max_session_duration = 43200
  tags                 = var.tags
}

resource "aws_iam_policy" "data_access" {
  name        = "${var.name}-data-access"
  description = "Read ${var.prompts_prefix}, read and write ${var.outputs_prefix} of the specbatch bucket."
  policy      = data.aws_iam_policy_document.data_access.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "data_access" {
  role       = aws_iam_role.ray.name
  policy_arn = aws_iam_policy.data_access.arn
}

# The scheduler pods (modules/workflows) read a dated prefix's _job.json before creating a
# run, so that a rerun of a finished date starts no GPUs. They may read that file only.
data "aws_iam_policy_document" "scheduler_trust" {
  count = var.scheduler_service_account == "" ? 0 : 1
  statement {
    sid     = "SchedulerPodsServiceAccount"
    effect  = "Allow"
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${var.scheduler_service_account}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "scheduler_access" {
  count = var.scheduler_service_account == "" ? 0 : 1
  statement {
    sid       = "ReadJobManifests"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = ["${var.bucket_arn}/${var.outputs_prefix}*/_job.json"]
  }
  statement {
    sid       = "BucketKeyViaS3"
    effect    = "Allow"
    actions   = ["kms:Decrypt"]
    resources = [var.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "scheduler" {
  count                = var.scheduler_service_account == "" ? 0 : 1
  name                 = "${var.name}-scheduler"
  description          = "Assumed by the specbatch scheduler pods (${var.namespace}/${var.scheduler_service_account}) through IRSA."
  assume_role_policy   = data.aws_iam_policy_document.scheduler_trust[0].json
  max_session_duration = 3600
  tags                 = var.tags
}

resource "aws_iam_role_policy" "scheduler" {
  count  = var.scheduler_service_account == "" ? 0 : 1
  name   = "read-job-manifests"
  role   = aws_iam_role.scheduler[0].id
  policy = data.aws_iam_policy_document.scheduler_access[0].json
}
