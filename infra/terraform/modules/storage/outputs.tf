output "bucket_name" {
  description = "Name of the bucket."
  value       = aws_s3_bucket.this.bucket
}

output "bucket_arn" {
  description = "ARN of the bucket."
  value       = aws_s3_bucket.this.arn
}

output "kms_key_arn" {
  description = "ARN of the KMS key that encrypts the bucket (readers and writers need kms:Decrypt / kms:GenerateDataKey on it)."
  value       = aws_kms_key.bucket.arn
}

output "prompts_uri" {
  description = "s3:// URI of the prompts prefix."
  value       = "s3://${aws_s3_bucket.this.bucket}/${var.prompts_prefix}"
}

output "outputs_uri" {
  description = "s3:// URI of the outputs prefix."
  value       = "s3://${aws_s3_bucket.this.bucket}/${var.outputs_prefix}"
}

output "prompts_prefix" {
  description = "Key prefix of the prompt shards."
  value       = var.prompts_prefix
}

output "outputs_prefix" {
  description = "Key prefix of job outputs."
  value       = var.outputs_prefix
}
