output "role_arn" {
  description = "ARN of the role; annotate the Ray service account with eks.amazonaws.com/role-arn = this."
  value       = aws_iam_role.ray.arn
}

output "role_name" {
  description = "Name of the role."
  value       = aws_iam_role.ray.name
}

output "policy_json" {
  description = "The data-access policy document, for review."
  value       = data.aws_iam_policy_document.data_access.json
}

output "scheduler_role_arn" {
  description = "ARN of the scheduler pods' role (reads _job.json only); empty without scheduler_service_account."
  value       = var.scheduler_service_account == "" ? "" : aws_iam_role.scheduler[0].arn
}
