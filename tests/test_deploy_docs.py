"""docs/deploy.md against what it describes: every service, command, file, setting and build
argument it names must exist, so the page cannot drift from the stack silently."""

from __future__ import annotations

import re
import shlex

import pytest

from tests._deploy_support import (
    COMPOSE_FILE,
    DEPLOY_DOC,
    REPO,
    compose_model,
    dockerfile_args,
    env_example,
)

REQUIRED_SECTIONS = {
    "start the stack", "trigger the dag from the ui", "object store: aws s3 or another minio",
    "spark on an existing cluster", "training on several gpus and nodes",
    "where outputs land; resume and roll back", "build the image",
}


@pytest.fixture(scope="module")
def doc() -> str:
    assert DEPLOY_DOC.is_file(), "docs/deploy.md is missing"
    return DEPLOY_DOC.read_text()


def _slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def test_required_sections_and_anchors(doc):
    headings = [h for h in re.findall(r"^#{2,4} (.+)$", doc, re.M)]
    assert REQUIRED_SECTIONS <= {h.lower() for h in headings}
    slugs = {_slug(h) for h in headings}
    for anchor in re.findall(r"\]\(#([^)]+)\)", doc):
        assert anchor in slugs, f"link to #{anchor}, no such heading"


def test_services_table_matches_compose(doc):
    table = doc.split("| service |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M))
    assert named == set(compose_model()["services"])


def _compose_commands(doc: str) -> list[list[str]]:
    text = doc.replace("\\\n", " ")
    out = []
    for m in re.finditer(r"docker compose ([^\n`|]+)", text):
        line = m.group(1).split("#")[0].split("&&")[0]
        try:
            out.append(shlex.split(line))
        except ValueError:
            out.append(line.split())
    return out


def test_compose_commands_name_existing_services(doc):
    services = set(compose_model()["services"])
    with_value = {"-e", "--entrypoint", "--env-file", "--profile", "-u", "--user", "-w"}
    seen = 0
    for argv in _compose_commands(doc):
        verb, rest = argv[0], argv[1:]
        if verb in ("run", "exec", "logs", "restart", "stop", "start"):
            targets, skip = [], False
            for word in rest:
                if skip:
                    skip = False
                elif word in with_value:
                    skip = True
                elif not word.startswith("-"):
                    targets.append(word)
                    if verb in ("run", "exec"):
                        break
            assert targets and all(t in services for t in targets), f"docker compose {' '.join(argv)}"
            seen += 1
        for i, word in enumerate(rest):
            if word == "--scale":
                assert rest[i + 1].split("=")[0] in services
    assert seen >= 4


def test_repository_paths_exist(doc):
    names = set(re.findall(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+\.(?:py|json|sh|txt|yaml|md|in))`", doc))
    names |= set(re.findall(r"`(Dockerfile|docker-compose\.yaml|\.env\.example|\.hadolint\.yaml)`", doc))
    names |= {p.rstrip("/") for p in re.findall(r"`((?:dags|plugins|spark_jobs|training|deploy|requirements)/)`", doc)}
    assert len(names) >= 10
    missing = sorted(n for n in names if not (REPO / n).exists())
    assert not missing, f"docs/deploy.md names files that do not exist: {missing}"


def test_settings_and_variables_exist(doc):
    from pipeline_core.config import Config
    from plugins.mft_airflow.settings import DeploySettings

    for field in re.findall(r"MFT_DEPLOY__([A-Z0-9_]+)", doc):
        if field.endswith("_"):  # a family, written MFT_DEPLOY__SPARK_*
            assert any(f.startswith(field.lower()) for f in DeploySettings.model_fields), field
            continue
        assert field.lower() in DeploySettings.model_fields, f"MFT_DEPLOY__{field} is not a deployment setting"
    for field in re.findall(r"`(?:MFT_DEPLOY__)?([A-Z0-9_]+)`", doc.split("Deployment settings the DAG reads", 1)[1]
                            .split("Pipeline", 1)[0]):
        if field.isupper() and "_" not in field[:1]:
            assert field.lower() in DeploySettings.model_fields or field in env_example(), field
    sections = Config.model_fields
    for section, field in re.findall(r"MFT__([A-Z]+)__([A-Z0-9_]+)", doc):
        model = sections[section.lower()].annotation
        assert field.lower() in model.model_fields, f"MFT__{section}__{field} is not a config field"
    for dotted in re.findall(r'"(train|filter|enrich|pipeline|storage)\.([a-z_]+)"', doc):
        assert dotted[1] in sections[dotted[0]].annotation.model_fields, ".".join(dotted)
    compose_text = COMPOSE_FILE.read_text()
    # the image scripts' and image tests' own knobs (MFT_TORCH_VARIANT, MFT_STACK_*_TIMEOUT_S, ...)
    image_tooling = "".join(p.read_text() for p in (*(REPO / "deploy" / "image").glob("*.sh"),
                                                    *(REPO / "tests").glob("test_deploy_*.py")))
    env_names = set(env_example())
    for var in set(re.findall(r"`((?:MFT|AIRFLOW|MINIO|AWS|SPARK_WORKER|TRAIN|POSTGRES)_[A-Z0-9_]+)`", doc)):
        if "__" in var:  # MFT__ / MFT_DEPLOY__ / AIRFLOW__: checked against their classes above
            continue
        assert var in env_names or var in compose_text or var in dockerfile_args() or var in image_tooling, (
            f"{var} is not in .env.example, docker-compose.yaml, the Dockerfile's ARGs or the image scripts")


def test_build_arguments_exist(doc):
    table = doc.split("| argument | default | meaning |", 1)[1].split("\n\n", 1)[0]
    args = dockerfile_args()
    for row in table.splitlines()[2:]:
        names = re.findall(r"`([A-Z0-9_]+)`", row.split("|")[1])
        assert names, row
        for name in names:
            assert name in args, f"build argument {name} is not in the Dockerfile"
