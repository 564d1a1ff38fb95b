"""The `evaluate` task (issue 31.2) on each launcher: the trainer's machinery (image, GPUs, mounts,
credentials, watched subprocess) with the benchmark command `training.benchmarks`, rendered from the
run's plan; a Kubernetes eval is one pod, the Docker eval a container of its own name."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from plugins.mft_airflow.operators import EvalOperator, eval_operator
from plugins.mft_airflow.settings import load_settings
from tests.test_dag_launchers import _prepared, creds, plan, rendered, s3_env  # noqa: F401  (fixtures)


def _eval_args(plan):  # noqa: F811
    return ["-m", "training.benchmarks", "--input", plan.model_uri, "--output", plan.eval_uri,
            "--config", plan.config_file]


def _eval_op(**settings):
    return eval_operator(load_settings(env={}, **settings), task_id="evaluate")


def test_local_eval_runs_the_benchmark_module_from_the_workers_interpreter(plan):  # noqa: F811
    op = rendered(_eval_op(local_nproc_per_node=2), plan)
    assert isinstance(op, EvalOperator) and op.output_field == "eval_uri" and not op.prefetch_base
    assert op.command == [sys.executable, *_eval_args(plan)]
    assert plan.eval_uri == plan.run_uri + "/eval"


def test_docker_eval_is_the_trainer_image_with_the_benchmark_command(plan, creds):  # noqa: F811
    op = _prepared(_eval_op(launcher="docker", image="registry.example/mft:1.2", gpus=1), plan)
    assert op.image == "registry.example/mft:1.2" and op.command == ["python", *_eval_args(plan)]
    assert op.container_name == "mft-train-r1-eval"  # not the trainer's: both may exist for one run
    assert op.environment["AWS_SHARED_CREDENTIALS_FILE"] == "/run/secrets/aws_credentials"
    op._remove_secret()


def test_kubernetes_eval_is_a_one_pod_job(plan, creds):  # noqa: F811
    op = _prepared(_eval_op(launcher="kubernetes", image="registry.example/mft:1.2", gpus=1, nnodes=2,
                            staging_pvc="mft-staging", s3_secret="mft-s3"), plan)
    op.__dict__["hook"] = SimpleNamespace(is_in_cluster=False)
    job = op.build_job_request_obj(context=None)
    assert job.metadata.name == "job-mft-train-r1-eval" and job.spec.completions == job.spec.parallelism == 1
    [c] = job.spec.template.spec.containers
    assert c.command + c.args == ["python", *_eval_args(plan)]
    assert [e.secret_ref.name for e in c.env_from] == ["mft-s3"]
