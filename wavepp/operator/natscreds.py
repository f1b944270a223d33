"""NATS credentials the operator renders for a pipeline: one Secret
``{pipeline}-nats-creds`` with a ``.creds`` per component user of ``wavepp.api.permissions``,
signed by the account whose seed the operator was given (``WAVEPP_NATS_ACCOUNT_SEED_FILE``; the
chart mounts it). Each pod mounts only its own keys:

| pod                         | keys (Secret -> file under ``NATS_CREDS_DIR``)                  | ``--nats-creds``                |
| --------------------------- | --------------------------------------------------------------- | ------------------------------- |
| stage, replica i            | ``stage-{p}-r{i}-{r}.creds`` -> ``stage-{r}.creds``, every rank | ``stage-$(WAVEPP_RANK).creds``  |
| admission, replica i        | ``admission-{p}-r{i}.creds`` -> ``creds``                       | ``creds``                       |
| gateway                     | ``gateway-{p}.creds`` -> ``creds``                              | ``creds``                       |

(A StatefulSet's pods share one template, so a stage pod holds its replica's stage users.) The
credentials are derived from the account seed and the user (``derived_user_creds``): rendering
again gives the same Secret, and it changes only with the permissions. The gateway's user names
every replica's intake, so its pods carry a digest of its permissions (a scale-out rolls the
gateway, whose requests wait in JetStream). A spec that sets ``nats.credentialsSecret`` keeps
its own single ``creds`` file; an operator without an account seed renders none (insecure NATS,
logged at start).

The same Secret holds the pipeline's **bus key** (``bus.key``, hex; ``wavepp.api.signing``): every
pod mounts it and reads it through ``WAVEPP_BUS_KEY_FILE``, so plans, dones, KV ops, results and
heartbeats are signed and checked in the cluster as under ``wavepp up``. It is derived from the
account seed and the pipeline's namespace and name (HMAC-SHA256), so it is stable across
reconciles and differs per pipeline; without an account seed there is none (unsigned, warned).

Pure: no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from wavepp.api.natsauth import derived_user_creds
from wavepp.api.permissions import (
    NatsUser,
    admission_user_name,
    gateway_user,
    gateway_user_name,
    stage_user_name,
    users_for_pool,
)
from wavepp.api.spec import WavePipelineSpec
from wavepp.api.subjects import replica_pipeline_name
from wavepp.operator.naming import PipelineRef, child_metadata

NATS_CREDS_DIR = "/etc/wavepp-nats"
BUS_KEY_ITEM = "bus.key"
BUS_KEY_FILE = f"{NATS_CREDS_DIR}/{BUS_KEY_ITEM}"
ANNOTATION_GATEWAY_CREDS = "wavepp.dev/nats-gateway-permissions"


def nats_creds_secret_name(pipeline: str) -> str:
    return f"{pipeline}-nats-creds"


def uses_rendered_creds(spec: WavePipelineSpec, ref: PipelineRef) -> bool:
    """The spec's credentials are the operator's rendered Secret (see ``with_rendered_creds``)."""
    return spec.nats.credentials_secret == nats_creds_secret_name(ref.name)


def with_rendered_creds(spec: WavePipelineSpec, ref: PipelineRef) -> WavePipelineSpec:
    """The spec with ``nats.credentialsSecret`` set to the rendered Secret (unless it names one)."""
    if spec.nats.credentials_secret:
        return spec
    nats = spec.nats.model_copy(update={"credentials_secret": nats_creds_secret_name(ref.name)})
    return spec.model_copy(update={"nats": nats})


def _pipelines(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, int]:
    num = max(1, spec.num_replicas)
    return {replica_pipeline_name(ref.name, i): spec.num_stages for i in range(num)}


def pipeline_users(ref: PipelineRef, spec: WavePipelineSpec) -> list[NatsUser]:
    """Every component user of the pipeline resource (the pool is named after it)."""
    return users_for_pool(ref.name, _pipelines(ref, spec), namespace=ref.namespace)


def build_nats_creds_secret(
    ref: PipelineRef, spec: WavePipelineSpec, account_seed: str
) -> dict[str, Any]:
    """The Secret of every component's ``.creds`` (deterministic for a seed and a spec)."""
    data = {
        f"{user.name}.creds": base64.b64encode(
            derived_user_creds(account_seed, user).encode()
        ).decode()
        for user in pipeline_users(ref, spec)
    }
    data[BUS_KEY_ITEM] = base64.b64encode(derived_bus_key(account_seed, ref).encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(ref, nats_creds_secret_name(ref.name), "nats-credentials"),
        "type": "Opaque",
        "data": data,
    }


def derived_bus_key(account_seed: str, ref: PipelineRef) -> str:
    """The pipeline's bus key, hex (64 digits): HMAC-SHA256 of its namespace and name under the
    account seed (secret as long as the seed is; stable across reconciles)."""
    message = f"wavepp bus key\0{ref.namespace}/{ref.name}".encode()
    return hmac.new(account_seed.encode(), message, hashlib.sha256).hexdigest()


def creds_volume(
    component: str, ref: PipelineRef, spec: WavePipelineSpec, replica: int | None
) -> dict[str, Any]:
    """The pod's Secret volume holding only its component's keys."""
    if component == "stage":
        pipeline = replica_pipeline_name(ref.name, replica or 0)
        items = [
            {"key": f"{stage_user_name(pipeline, r)}.creds", "path": f"stage-{r}.creds"}
            for r in range(spec.num_stages)
        ]
    elif component == "admission":
        pipeline = replica_pipeline_name(ref.name, replica or 0)
        items = [{"key": f"{admission_user_name(pipeline)}.creds", "path": "creds"}]
    else:
        items = [{"key": f"{gateway_user_name(ref.name)}.creds", "path": "creds"}]
    items.append({"key": BUS_KEY_ITEM, "path": BUS_KEY_ITEM})  # every component signs/checks
    return {
        "name": "nats-creds",
        "secret": {
            "secretName": nats_creds_secret_name(ref.name),
            "items": items,
            "defaultMode": 0o400,
        },
    }


def creds_path(component: str) -> str:
    """The ``--nats-creds`` value of a component's container."""
    if component == "stage":
        return f"{NATS_CREDS_DIR}/stage-$(WAVEPP_RANK).creds"
    return f"{NATS_CREDS_DIR}/creds"


def gateway_permissions_digest(ref: PipelineRef, spec: WavePipelineSpec) -> str:
    """10 hex of the gateway user's permissions (a pod annotation: rolls the gateway when they
    change, so that it reconnects with the new credentials)."""
    perms = gateway_user(ref.name, list(_pipelines(ref, spec)), namespace=ref.namespace).permissions
    return hashlib.sha256(repr(perms).encode()).hexdigest()[:10]


def gateway_template_annotations(ref: PipelineRef, spec: WavePipelineSpec) -> dict[str, Any]:
    """``{"annotations": {...}}`` for the gateway's pod template with rendered credentials
    (the digest of its permissions), else ``{}``."""
    if not uses_rendered_creds(spec, ref):
        return {}
    return {"annotations": {ANNOTATION_GATEWAY_CREDS: gateway_permissions_digest(ref, spec)}}
