"""The team's servers (docs/team.md): :mod:`~pipelines.team.mlflow_server` (the shared MLflow tracking server
on PostgreSQL) and :mod:`~pipelines.team.s3_server` (an S3 server for a DVC remote), over
:mod:`~pipelines.team.service` (what every one of them shares: its folder, state file, secrets and command line)."""
