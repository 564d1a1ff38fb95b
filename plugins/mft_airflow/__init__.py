"""Airflow glue for the pipeline: deployment settings, the run plan, stage operators, launchers.

Nothing here imports a provider package at module level: the DAG file imports these modules at
parse time, and the provider operators (SparkSubmitOperator, DockerOperator,
KubernetesPodOperator) are built and run inside `execute`, where their import cost is paid once
per task instead of on every parse.
"""
