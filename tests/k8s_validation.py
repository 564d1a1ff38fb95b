"""What a Kubernetes API server would refuse in a manifest, checked without a cluster (none exists
here).

Two layers:
- the OpenAPI schema, as the installed `kubernetes` client package carries it: its models are
  generated from the cluster's OpenAPI document (`openapi_types`: field -> type, `attribute_map`:
  field -> JSON key, required fields refused as `None` by the setters). Every key of the manifest
  must be a field of its type (the API server's strict field validation, kubectl's default, refuses
  unknown fields; a lenient one drops them silently, which is worse), every value of the field's
  type, every required field present;
- the API server's own validation that no schema expresses (`pkg/apis/core/validation`,
  `pkg/apis/batch/validation`): DNS names and label values, quantities that parse, extended
  resources (GPUs) requested only with an equal limit, requests <= limits, mounts naming a volume
  of the pod, a Job's restart policy, an indexed Job's completions, a pod hostname of <= 63
  characters.

`problems(...)` returns every finding as a readable line; the tests assert it is empty.
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from typing import Any

from kubernetes.client import ApiClient, Configuration
from kubernetes.client import models as k8s
from kubernetes.utils import parse_quantity

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123 label, <= 63
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # <= 253
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")  # <= 63
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")  # a label key's name part
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object, "datetime": (str, datetime)}
# core resources the scheduler may overcommit; any other name (nvidia.com/gpu, ...) is extended
OVERCOMMITTABLE = {"cpu", "memory", "ephemeral-storage"}


def schema_problems(data: Any, type_name: str, path: str = "") -> list[str]:
    """Where `data` (the JSON form of a manifest) departs from the OpenAPI type `type_name`."""
    if type_name.startswith("list["):
        if not isinstance(data, list):
            return [f"{path}: expected a list ({type_name}), got {type(data).__name__}"]
        return [p for i, v in enumerate(data) for p in schema_problems(v, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("dict["):
        if not isinstance(data, dict):
            return [f"{path}: expected a map ({type_name}), got {type(data).__name__}"]
        value_type = type_name[5:-1].split(", ", 1)[1]
        return [p for k, v in data.items() for p in schema_problems(v, value_type, f"{path}.{k}")]
    if type_name in PRIMITIVES:
        want = PRIMITIVES[type_name]
        if data is None or (isinstance(data, bool) and type_name in ("int", "float")) or not isinstance(data, want):
            return [f"{path}: expected {type_name}, got {data!r}"]
        return []
    model = getattr(k8s, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name}), got {type(data).__name__}"]
    by_key = {key: attr for attr, key in model.attribute_map.items()}
    found = [f"{path}.{k}: unknown field of {type_name}" for k in data if k not in by_key]
    for key, value in data.items():
        if key in by_key and value is not None:
            found += schema_problems(value, model.openapi_types[by_key[key]], f"{path}.{key}")
    if not found:  # required fields: the generated setters refuse None for them
        try:
            ApiClient(Configuration())._ApiClient__deserialize(data, type_name)
        except ValueError as e:
            found.append(f"{path or type_name}: {e}")
    return found


def to_json(obj: Any) -> Any:
    """A client model as the API server receives it (camelCase keys, no nulls)."""
    return ApiClient().sanitize_for_serialization(obj)


def _names(path: str, meta: dict, *, service: bool = False) -> list[str]:
    out = []
    name = meta.get("name", "")
    rule, max_len = (DNS_1035_LABEL, 63) if service else (DNS_SUBDOMAIN, 253)
    if not rule.match(name) or len(name) > max_len:
        out.append(f"{path}.metadata.name {name!r}: not a valid {'DNS-1035 label' if service else 'DNS subdomain'}")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, base = key.rpartition("/")
        if not QUALIFIED_NAME.match(base) or len(base) > 63 or (prefix and not DNS_SUBDOMAIN.match(prefix)):
            out.append(f"{path}.metadata.labels: invalid key {key!r}")
        if not LABEL_VALUE.match(value) or len(value) > 63:
            out.append(f"{path}.metadata.labels[{key}]: invalid value {value!r}")
    return out


def _quantity(path: str, value: str) -> Decimal | None:
    try:
        return parse_quantity(value)
    except ValueError:
        return None


def _container_problems(path: str, c: dict, volume_names: set[str]) -> list[str]:
    out = []
    if not DNS_LABEL.match(c.get("name", "")):
        out.append(f"{path}.name {c.get('name')!r}: not a DNS label")
    res = c.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    for kind, values in (("requests", requests), ("limits", limits)):
        for name, q in values.items():
            if _quantity(path, q) is None:
                out.append(f"{path}.resources.{kind}[{name}]: {q!r} is not a quantity")
    for name in set(requests) | set(limits):
        extended = name not in OVERCOMMITTABLE and "/" in name and not name.startswith("kubernetes.io/")
        req, lim = requests.get(name), limits.get(name)
        if extended and lim is None:
            out.append(f"{path}.resources.limits[{name}]: limit must be set for non overcommitable resources")
        if extended and req is not None and lim is not None and _quantity(path, req) != _quantity(path, lim):
            out.append(f"{path}.resources.requests[{name}]: must be equal to {name} limit")
        if req is not None and lim is not None and None not in (_quantity(path, req), _quantity(path, lim)) \
                and _quantity(path, req) > _quantity(path, lim):
            out.append(f"{path}.resources.requests[{name}]: must be less than or equal to {name} limit")
    mount_paths = [m["mountPath"] for m in c.get("volumeMounts") or []]
    for m in c.get("volumeMounts") or []:
        if m["name"] not in volume_names:
            out.append(f"{path}.volumeMounts[{m['name']}]: not found among the pod's volumes")
    if len(set(mount_paths)) != len(mount_paths):
        out.append(f"{path}.volumeMounts: mount paths must be unique: {mount_paths}")
    for e in c.get("env") or []:
        if not ENV_NAME.match(e["name"]):
            out.append(f"{path}.env[{e['name']}]: invalid environment variable name")
    return out


def pod_spec_problems(path: str, spec: dict) -> list[str]:
    out = []
    volumes = [v["name"] for v in spec.get("volumes") or []]
    if len(set(volumes)) != len(volumes):
        out.append(f"{path}.volumes: duplicate names {volumes}")
    for v in spec.get("volumes") or []:
        limit = (v.get("emptyDir") or {}).get("sizeLimit")
        if limit is not None and _quantity(path, limit) is None:
            out.append(f"{path}.volumes[{v['name']}].emptyDir.sizeLimit: {limit!r} is not a quantity")
    names = [c["name"] for c in spec.get("containers") or []]
    if not names:
        out.append(f"{path}.containers: at least one container is required")
    if len(set(names)) != len(names):
        out.append(f"{path}.containers: duplicate names {names}")
    for i, c in enumerate(spec.get("containers") or []):
        out += _container_problems(f"{path}.containers[{i}]", c, set(volumes))
    if "subdomain" in spec and not DNS_LABEL.match(spec["subdomain"]):
        out.append(f"{path}.subdomain {spec['subdomain']!r}: not a DNS label")
    for t in spec.get("tolerations") or []:
        if t.get("operator") == "Exists" and t.get("value"):
            out.append(f"{path}.tolerations: value must be empty when operator is Exists")
    return out


def job_problems(job: Any) -> list[str]:
    """Everything a batch/v1 API server would refuse in this Job (a client model or its JSON)."""
    data = job if isinstance(job, dict) else to_json(job)
    out = schema_problems(data, "V1Job", "job")
    if out:
        return out
    meta, spec = data["metadata"], data["spec"]
    out += _names("job", meta)
    # the controller labels every pod `batch.kubernetes.io/job-name: <name>`: a label value
    if len(meta["name"]) > 63:
        out.append(f"job.metadata.name {meta['name']!r}: longer than 63 characters (it becomes a label value)")
    template = spec["template"]
    out += _names("job.spec.template", {"name": meta["name"], **template.get("metadata", {})})
    if template["spec"].get("restartPolicy") not in ("Never", "OnFailure"):
        out.append(f"job.spec.template.spec.restartPolicy {template['spec'].get('restartPolicy')!r}: "
                   "a Job's pods must use Never or OnFailure")
    if spec.get("completionMode") == "Indexed":
        completions = spec.get("completions")
        if completions is None:
            out.append("job.spec.completions: required when completionMode is Indexed")
        # each pod's hostname is <job>-<index>: a DNS label
        elif len(f"{meta['name']}-{completions - 1}") > 63:
            out.append(f"job: pod hostname {meta['name']}-{completions - 1} is longer than 63 characters")
    out += pod_spec_problems("job.spec.template.spec", template["spec"])
    return out


def service_problems(service: Any) -> list[str]:
    """Everything a core/v1 API server would refuse in this Service."""
    data = service if isinstance(service, dict) else to_json(service)
    out = schema_problems(data, "V1Service", "service")
    if out:
        return out
    out += _names("service", data["metadata"], service=True)
    for p in data["spec"].get("ports") or []:
        if not 1 <= p["port"] <= 65535:
            out.append(f"service.spec.ports[{p.get('name')}]: port {p['port']} out of range")
        if p.get("name") and (not DNS_LABEL.match(p["name"]) or len(p["name"]) > 15):
            out.append(f"service.spec.ports: name {p['name']!r} is not an IANA service name")
    return out
