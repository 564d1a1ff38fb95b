"""docker-compose.yaml, checked by the real Docker Compose v2 (`config`: schema validation and
interpolation, no engine needed) and against the project's own code: the connections parse with
the real Airflow providers, the MFT__ / MFT_DEPLOY__ variables load through the real config
classes, and every command is an entry point that exists."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests._deploy_support import (
    COMPOSE_FILE,
    ENV_EXAMPLE,
    REPO,
    SECRET_NAME,
    clean_env,
    compose_binary,
    compose_model,
    compose_raw,
    env_example,
    image_path_to_repo,
    run_compose,
    service_argv,
    uses_project_image,
)

SERVICES = {
    "postgres", "minio", "minio-init", "staging-init", "spark-master", "spark-worker",
    "airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
    "airflow-triggerer", "trainer", "mlflow-db-init", "mlflow",
}
AIRFLOW_LONG_RUNNING = {"airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"}
ONE_SHOT = {"minio-init", "staging-init", "airflow-init", "trainer", "mlflow-db-init"}
# bind-mount sources outside the repository must come from .env (host paths the user chooses)
HOST_PATH_VARS = {"MFT_STAGING_DIR", "DOCKER_SOCKET"}


@pytest.fixture(scope="module")
def model() -> dict:
    return compose_model()


@pytest.fixture(scope="module")
def services(model) -> dict:
    return model["services"]


def test_compose_file_is_valid(model):
    assert model["name"] == "mft"


def test_validator_rejects_an_invalid_file(tmp_path):
    bad = tmp_path / "docker-compose.yaml"
    bad.write_text(COMPOSE_FILE.read_text().replace("    shm_size: 32gb\n", "    shm_size: 32gb\n    gpus_wanted: 2\n"))
    proc = run_compose("config", "-q", compose_file=bad)
    assert proc.returncode != 0 and "gpus_wanted" in proc.stderr


def test_missing_secrets_fail_instead_of_defaulting(tmp_path):
    env = tmp_path / "empty.env"
    env.write_text("")
    proc = run_compose("config", "-q", env_file=env)
    assert proc.returncode != 0
    assert "required variable" in proc.stderr and "is missing a value" in proc.stderr, proc.stderr


def test_every_expected_service_exists(services):
    assert set(services) == SERVICES


def test_trainer_requests_nvidia_gpus_and_big_shm(services):
    trainer = services["trainer"]
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert int(trainer["shm_size"]) >= 8 * 1024**3
    assert trainer["ulimits"]["memlock"] == -1
    assert trainer["profiles"] == ["train"], "the trainer must not start with a plain `up`"


def test_published_ports_bind_to_loopback(services):
    published = [(name, p) for name, s in services.items() for p in s.get("ports", [])]
    assert published, "the UIs should be reachable from the host"
    for name, port in published:
        assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond loopback"


def test_env_example_holds_placeholders_only():
    values = env_example()
    secrets = {k: v for k, v in values.items() if SECRET_NAME.search(k) and k != "AWS_ACCESS_KEY_ID"}
    assert {"POSTGRES_PASSWORD", "AWS_SECRET_ACCESS_KEY", "AIRFLOW_FERNET_KEY", "MINIO_ROOT_PASSWORD"} <= set(secrets)
    leaked = {k: v for k, v in secrets.items() if v not in ("", "change-me")}
    assert not leaked, f".env.example must not hold secret values: {sorted(leaked)}"


def _raw_env_blocks():
    raw = compose_raw()
    for name, block in raw.items():
        if name.startswith("x-") and isinstance(block, dict):
            yield name, block.get("environment", block)
    for name, svc in raw["services"].items():
        yield name, svc.get("environment") or {}


def test_compose_holds_no_secret_values():
    interp = re.compile(r"^\$\{[A-Z0-9_]+(:?\?[^}]*|:-)?\}$")
    for where, env in _raw_env_blocks():
        assert isinstance(env, dict), f"{where}: use a mapping for environment"
        for key, value in env.items():
            if key == "<<":
                continue
            if SECRET_NAME.search(key):
                assert interp.match(str(value)), f"{where}.{key}: secrets only as ${{VAR}} from .env, got {value!r}"
            if key.startswith("AIRFLOW_CONN_"):
                conn = json.loads(value)
                for field in ("login", "password"):
                    if field in conn:
                        assert interp.match(conn[field]), f"{where}.{key}.{field} must come from .env"
    text = COMPOSE_FILE.read_text() + ENV_EXAMPLE.read_text()
    assert not re.search(r"AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY|minioadmin", text)


def test_dot_env_is_ignored_by_git():
    assert subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=REPO).returncode == 0
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=REPO, capture_output=True, text=True).stdout
    assert tracked.strip() == ""


def test_init_env_generates_working_secrets(tmp_path):
    target = tmp_path / ".env"
    script = REPO / "deploy" / "init-env.sh"
    proc = subprocess.run([str(script), str(target)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert oct(target.stat().st_mode & 0o777) == "0o600"
    values = dict(line.split("=", 1) for line in target.read_text().splitlines() if line and not line.startswith("#"))
    assert set(values) == set(env_example())
    assert "change-me" not in values.values()
    assert len({values[k] for k in ("POSTGRES_PASSWORD", "AWS_SECRET_ACCESS_KEY", "MINIO_ROOT_PASSWORD")}) == 3
    from cryptography.fernet import Fernet

    Fernet(values["AIRFLOW_FERNET_KEY"].encode())  # raises on a malformed key
    assert Path(values["MFT_STAGING_DIR"]).is_absolute() and Path(values["MFT_STAGING_DIR"]).is_dir()
    assert run_compose("config", "-q", env_file=target).returncode == 0
    again = subprocess.run([str(script), str(target)], capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "not overwriting" in again.stderr


def test_mounted_and_built_paths_exist(services):
    env = env_example()
    host_paths = {env.get(v, "") for v in HOST_PATH_VARS} | {"/var/run/docker.sock"}
    for name, svc in services.items():
        if "build" in svc:
            ctx = Path(svc["build"]["context"])
            assert ctx == REPO and (ctx / svc["build"]["dockerfile"]).is_file()
        for vol in svc.get("volumes", []):
            if vol["type"] != "bind":
                continue
            src = Path(vol["source"])
            if src.is_relative_to(REPO):
                assert src.exists(), f"{name} mounts {src}, which is not in the repository"
                # a mount over the image's copy of the repo must mount the same directory
                assert image_path_to_repo(vol["target"]) in (src, None), (name, vol)
            else:
                assert str(src) in host_paths, f"{name} mounts host path {src} not set through .env"


def test_dags_and_plugins_mounts_match_airflow_folders(services):
    from tests._deploy_support import final_stage_env

    env = final_stage_env()
    for name in AIRFLOW_LONG_RUNNING | {"airflow-init"}:
        targets = {v["target"]: v for v in services[name]["volumes"]}
        for folder in ("AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__CORE__PLUGINS_FOLDER"):
            mount = targets.get(env[folder])
            assert mount and mount["type"] == "bind" and mount.get("read_only"), (name, folder)


def _airflow_cli_ok(words: list[str]) -> bool:
    from airflow.cli.cli_config import core_commands

    by_name = {c.name: c for c in core_commands}
    cmd = by_name.get(words[0])
    if cmd is None:
        return False
    subs = getattr(cmd, "subcommands", None)
    return not subs or (len(words) > 1 and words[1] in {s.name for s in subs})


def _spark_class_exists(cls: str) -> bool:
    import pyspark

    path = cls.replace(".", "/") + ".class"
    for jar in (Path(pyspark.__file__).parent / "jars").glob("spark-core_*.jar"):
        if path in zipfile.ZipFile(jar).namelist():
            return True
    return False


def _module_file(module: str) -> Path:
    return REPO / (module.replace(".", "/") + ".py")


def test_commands_are_real_entry_points(services):
    checked = set()
    for name, svc in services.items():
        if not uses_project_image(svc):
            continue
        argv = service_argv(svc)
        # shell scripts (bash -c '...'): every `airflow ...` line inside must be a real command
        script = argv[2] if argv[:1] == ["bash"] and len(argv) > 2 else None
        lines = script.replace("\\\n", " ").splitlines() if script else [shlex.join(argv)]
        for line in lines:
            words = shlex.split(line) if line.strip() else []
            if words[:1] == ["airflow"]:
                assert _airflow_cli_ok(words[1:]), f"{name}: `{line}` is not an Airflow 3 command"
                checked.add(name)
        if argv[:1] == ["spark-class"]:
            assert _spark_class_exists(argv[1]), f"{name}: {argv[1]} not in pyspark's jars"
            checked.add(name)
        if argv[:1] == ["torchrun"]:
            module = argv[argv.index("-m") + 1]
            assert _module_file(module).is_file(), f"{name}: {module} does not exist"
            checked.add(name)
        for word in argv:
            repo_path = image_path_to_repo(word)
            if repo_path is not None:
                assert repo_path.exists(), f"{name} runs {word}, missing from the repository"
    assert checked >= AIRFLOW_LONG_RUNNING | {"airflow-init", "spark-master", "spark-worker", "trainer"}


def test_trainer_runs_what_the_dag_docker_launcher_runs(services):
    from plugins.mft_airflow.settings import load_settings

    settings = load_settings(env=services["airflow-scheduler"]["environment"])
    argv = service_argv(services["trainer"])
    assert argv[argv.index("-m") + 1] == settings.train_module
    assert _module_file(settings.train_module).is_file()
    assert services["trainer"]["image"] == settings.image


def test_pipeline_stage_files_exist():
    """The files the stack runs and the docs name: the DAG, both Spark apps, the trainer."""
    from plugins.mft_airflow.settings import load_settings

    settings = load_settings(env={})
    for rel in ("dags/mistral_finetune.py", "spark_jobs/enrich/job.py", "spark_jobs/filter/job.py",
                "training/train.py", "training/ds_config.json"):
        assert (REPO / rel).is_file(), f"{rel} is missing"
    assert Path(settings.spark_app_dir) == REPO / "spark_jobs"
    assert '"mistral_finetune"' in (REPO / "dags/mistral_finetune.py").read_text().replace("'", '"')


def _service_env(services, name) -> dict[str, str]:
    return {k: ("" if v is None else str(v)) for k, v in (services[name].get("environment") or {}).items()}


def test_spark_connection_resolves_to_the_master_service(services, monkeypatch):
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    env = _service_env(services, "airflow-scheduler")
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", env["AIRFLOW_CONN_SPARK_DEFAULT"])
    conn = SparkSubmitHook(conn_id="spark_default")._connection
    master = urlparse(conn["master"])
    master_argv = service_argv(services["spark-master"])
    assert master.scheme == "spark" and master.hostname in services
    assert master.port == int(master_argv[master_argv.index("--port") + 1])
    assert conn["deploy_mode"] == "client"  # the driver runs in the scheduler, which has the staging mount
    worker_argv = service_argv(services["spark-worker"])
    assert conn["master"] in worker_argv


def test_object_store_settings_load_and_point_at_minio(services, monkeypatch):
    from airflow.models.connection import Connection

    from pipeline_core.config import load_config

    bucket = services["minio-init"]["environment"]["MFT_BUCKET"]
    for name, svc in services.items():
        if not uses_project_image(svc) or name == "staging-init":
            continue
        env = _service_env(services, name)
        cfg = load_config(env=env)  # unknown MFT__ names or bad values raise here
        assert cfg.pipeline.store_uri.startswith(f"s3://{bucket}/"), (name, cfg.pipeline.store_uri)
        endpoint = urlparse(cfg.storage.endpoint_url)
        assert endpoint.hostname == "minio" and endpoint.port == 9000, name
        assert cfg.pipeline.staging_uri == "file:///data/staging"
        assert any(v["target"] == "/data/staging" for v in svc["volumes"]), f"{name} lacks the staging mount"
        assert env["AWS_ACCESS_KEY_ID"] == services["minio-init"]["environment"]["AWS_ACCESS_KEY_ID"]
    conn = Connection.from_json(_service_env(services, "airflow-scheduler")["AIRFLOW_CONN_MFT_OBJECT_STORE"],
                                conn_id="mft_object_store")
    assert conn.conn_type == "aws" and urlparse(conn.extra_dejson["endpoint_url"]).hostname == "minio"


def test_deploy_settings_match_the_stack(model, services):
    from plugins.mft_airflow.settings import load_settings

    env = _service_env(services, "airflow-scheduler")
    settings = load_settings(env=env)  # unknown MFT_DEPLOY__ names or bad values raise here
    assert settings.launcher == "docker"
    assert settings.image == services["trainer"]["image"]
    assert settings.docker_network in {n["name"] for n in model["networks"].values()}
    staging = {v["source"] for v in services["airflow-scheduler"]["volumes"] if v["target"] == "/data/staging"}
    assert staging == {settings.shared_volume}
    assert f"AIRFLOW_CONN_{settings.spark_conn_id.upper()}" in env
    assert any(v["target"] == "/var/run/docker.sock" for v in services["airflow-scheduler"]["volumes"])
    # the gpu pool airflow-init creates: tests/test_deploy_smoke.py runs its script


def test_airflow_components_share_one_configuration(services):
    envs = {name: _service_env(services, name) for name in AIRFLOW_LONG_RUNNING | {"airflow-init"}}
    keys = ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "AIRFLOW__CORE__EXECUTOR")
    for key in keys:
        assert len({e[key] for e in envs.values()}) == 1, f"{key} differs between Airflow components"
    api = urlparse(envs["airflow-scheduler"]["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    api_argv = service_argv(services["airflow-apiserver"])
    assert api.hostname == "airflow-apiserver" and api.port == int(api_argv[api_argv.index("--port") + 1])
    db = urlparse(envs["airflow-scheduler"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    assert db.hostname == "postgres" and db.password == services["postgres"]["environment"]["POSTGRES_PASSWORD"]


def test_dependencies_wait_for_health_and_init(services):
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"
            if spec["condition"] == "service_completed_successfully":
                assert dep in ONE_SHOT, (name, dep)
    for name, svc in services.items():
        if name not in ONE_SHOT:
            assert "healthcheck" in svc, f"{name} is long-running and has no healthcheck"
            assert svc.get("restart") == "unless-stopped", name
    for name in AIRFLOW_LONG_RUNNING:
        deps = services[name]["depends_on"]
        assert deps["postgres"]["condition"] == "service_healthy"
        assert deps["airflow-init"]["condition"] == "service_completed_successfully"
    assert services["airflow-scheduler"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"


def test_project_services_run_as_the_image_user(services):
    uid = env_example()["MFT_UID"]
    for name, svc in services.items():
        if uses_project_image(svc) and name != "staging-init":
            assert svc["user"] == f"{uid}:0", name


def test_compose_binary_is_the_real_one():
    proc = run_compose("version")
    assert proc.returncode == 0 and re.search(r"v2\.\d+\.\d+", proc.stdout), proc.stdout


def test_airflow_options_exist_in_airflow_3(services):
    """A misspelt AIRFLOW__SECTION__KEY is silently ignored by Airflow; check each one is real."""
    from airflow.configuration import retrieve_configuration_description

    from tests._deploy_support import final_stage_env

    known = retrieve_configuration_description()
    names = {k for s in services.values() for k in (s.get("environment") or {}) if k.startswith("AIRFLOW__")}
    names |= {k for k in final_stage_env() if k.startswith("AIRFLOW__")}
    assert len(names) > 10
    for name in sorted(names):
        section, key = name[len("AIRFLOW__"):].lower().split("__", 1)
        assert key in known.get(section, {}).get("options", {}), f"{name} is not an Airflow {section} option"
    health = known["scheduler"]["options"]["scheduler_health_check_server_port"]["default"]
    assert f"localhost:{health}/health" in " ".join(services["airflow-scheduler"]["healthcheck"]["test"])


def test_ci_override_keeps_every_service_on_loopback(tmp_path):
    """docker-compose.ci.yaml (the stack `make image-test` runs): Compose validates the pair; every
    service shares the host's network (no bridge, no network created, nothing published), and
    every server it starts binds 127.0.0.1 on a port from the env file."""
    env = tmp_path / "ci.env"
    ports = {f"MFT_CI_{k}_PORT": str(20001 + i) for i, k in enumerate(
        ("API", "PG", "S3", "SPARK", "SPARK_UI", "SPARK_WORKER_UI", "SCHEDULER_HEALTH"))}
    env.write_text(ENV_EXAMPLE.read_text() + "".join(f"{k}={v}\n" for k, v in ports.items())
                   + "MFT_S3_ENDPOINT_URL=http://127.0.0.1:20003\n")
    cmd = [str(compose_binary()), "--project-directory", str(REPO), "-f", str(COMPOSE_FILE),
           "-f", str(REPO / "docker-compose.ci.yaml"), "--env-file", str(env), "config", "--format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    ci = json.loads(proc.stdout)
    assert not ci.get("networks"), f"the CI stack must not create networks: {ci.get('networks')}"
    for name, svc in ci["services"].items():
        assert svc.get("network_mode") == "host", f"{name} is not on the host network"
        assert not svc.get("ports"), f"{name} publishes ports"
        assert not svc.get("networks"), name
    argv = {name: service_argv(svc) for name, svc in ci["services"].items()}
    assert argv["airflow-apiserver"][-4:] == ["--host", "127.0.0.1", "--port", ports["MFT_CI_API_PORT"]]
    assert argv["minio"][-4:] == ["-H", "127.0.0.1", "-p", ports["MFT_CI_S3_PORT"]]
    for name in ("spark-master", "spark-worker"):
        assert argv[name][argv[name].index("--host") + 1] == "127.0.0.1", name
        assert ci["services"][name]["environment"]["SPARK_LOCAL_IP"] == "127.0.0.1"
    sched = ci["services"]["airflow-scheduler"]["environment"]
    assert sched["AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_HOST"] == "127.0.0.1"
    assert "--skip-serve-logs" in argv["airflow-scheduler"] and "--skip-serve-logs" in argv["airflow-triggerer"]
    assert "@127.0.0.1:" + ports["MFT_CI_PG_PORT"] + "/" in sched["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    # the override replaces only the images that cannot be pulled here; MinIO stays in production
    assert compose_model()["services"]["minio"]["image"].startswith("minio/minio:")
    assert ci["services"]["postgres"]["image"] == "mft-postgres:ci"


def test_pipeline_key_is_limited_to_the_buckets_object_actions(services):
    """minio-init's policy for the pipeline's key: list the bucket, read/write/delete its objects,
    multipart uploads; no wildcard, nothing that changes the bucket (policy, versioning, lifecycle)
    or deletes old versions, and nothing outside the bucket."""
    script = services["minio-init"]["command"][0].replace("$$", "$")
    policy_text = script.split("<<EOF", 1)[1].split("\nEOF", 1)[0]
    bucket = services["minio-init"]["environment"]["MFT_BUCKET"]
    policy = json.loads(policy_text.replace("${MFT_BUCKET}", bucket))
    grants = {(a, r) for st in policy["Statement"] for a in st["Action"] for r in st["Resource"]}
    assert all(st["Effect"] == "Allow" for st in policy["Statement"])
    bucket_arn, objects_arn = f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"
    assert grants == {
        *((a, bucket_arn) for a in ("s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads")),
        *((a, objects_arn) for a in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                     "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts")),
    }, sorted(grants)
    assert "mc admin policy attach local mft-rw --user" in script.replace("\\\n", " ")
