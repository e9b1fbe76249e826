"""The only module that calls the Kubernetes API: one async client (aiohttp).

Objects are plain dicts (what the builders make), sent and read as JSON. One aiohttp session
per event loop (the operator's; a test's own), all with the one configuration. The official
``kubernetes`` package is used only to load that configuration (:func:`configure`): in-cluster
(the service account token, re-read as the kubelet rotates it) or a kubeconfig with whatever
it holds (client certificates, exec credential plugins, auth providers, their token refresh);
no request goes through it.
Every call is idempotent or made so: :func:`acreate_or_get` treats 409 AlreadyExists as success
after checking that the existing object is ours (its controller ownerReference has this PPOJob's
uid), so re-running a handler never makes a second child. An existing object that is not ours is
never adopted: one being deleted, or still owned by an earlier PPOJob of the same name that the
garbage collector has not reached yet, raises :class:`ChildWaiting` (the caller retries with
backoff); anything else (unowned, or another owner) raises :class:`ChildConflict`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from ppojob_api.spec import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger(__name__)

# apiVersion, kind -> (plural, namespaced)
KINDS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Event"): "events",
    ("v1", "Pod"): "pods",
    ("v1", "Namespace"): "namespaces",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("ray.io/v1", "RayJob"): "rayjobs",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "podgroups",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("kueue.x-k8s.io/v1beta1", "Workload"): "workloads",
    ("kueue.x-k8s.io/v1beta2", "Workload"): "workloads",
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): "localqueues",
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"): "clusterqueues",
    ("kueue.x-k8s.io/v1beta2", "AdmissionCheck"): "admissionchecks",
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    ("apps/v1", "Deployment"): "deployments",
    (f"{GROUP}/{VERSION}", KIND): PLURAL,
}


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {body[:4000]}")
        self.status = status
        self.reason = reason
        self.body = body


class Replaced(ApiError):
    """A conditional delete's 409 Conflict: the name now holds another object than the one
    the delete was decided about (its uid differs), which is therefore already gone."""


class ChildConflict(Exception):
    """A child's name is taken by an object that is not this PPOJob's (unowned, or controlled
    by another owner): never adopted; the user must remove or rename it."""


class ChildRefused(Exception):
    """The API server refused to create a child (any answer but 409 and the transient ones
    :func:`arequest` retries): a missing CRD (404), a ResourceQuota or RBAC refusal (403), an
    admission webhook's or the schema's verdict (400, 422). The text names the child and carries
    the API server's own message."""

    def __init__(self, obj: dict[str, Any], exc: ApiError) -> None:
        meta = obj.get("metadata") or {}
        what = f"{obj.get('kind')} {meta.get('namespace')}/{meta.get('name')}"
        super().__init__(f"cannot create {what}: HTTP {exc.status}: {api_message(exc)}")
        self.status = exc.status


def api_message(exc: ApiError) -> str:
    """The API server's ``Status.message`` of an error answer (else its body, shortened)."""
    try:
        doc = json.loads(exc.body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("message"):
        return str(doc["message"])[:1000]
    return (exc.body or exc.reason)[:1000]


class ChildVanished(Exception):
    """The object answered 409 (it exists) and was gone when read back: deleted in between."""


class ChildWaiting(Exception):
    """A child's name is still held by an object on its way out (being deleted, or owned by an
    earlier PPOJob of the same name awaiting garbage collection): retry later."""


@dataclass
class _State:
    config: Any = None  # a kubernetes.client.Configuration
    # event loop -> (the configuration it was made for, its aiohttp session)
    sessions: dict[Any, tuple[Any, Any]] = field(default_factory=dict)
    auth: tuple[float, str | None, str] | None = None  # (monotonic time, header, host)


_state = _State()
_lock = threading.Lock()


def configure(host: str | None = None, *, token: str | None = None, pool_size: int = 32) -> None:
    """Load the configuration: explicit ``host`` (tests), else in-cluster, else kubeconfig.
    Raises ``kubernetes.config.ConfigException`` when there is none."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if host:
        cfg.host = host
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            # $KUBECONFIG as it is now: the client reads it once, when first imported
            kubeconfig = os.environ.get("KUBECONFIG") or None
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = pool_size
    with _lock:
        _state.config = cfg
        _state.auth = None


def path_for(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """URL path of a collection or an object."""
    plural = KINDS.get((api_version, kind))
    if plural is None:
        raise ValueError(f"unknown kind {api_version}/{kind}")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = base + (f"/namespaces/{quote(namespace)}" if namespace else "") + f"/{plural}"
    if name:
        path += f"/{quote(name)}"
    if subresource:
        path += f"/{subresource}"
    return path


def controller_ref(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The object's controller ownerReference, if it has one."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def check_owner(obj: dict[str, Any], existing: dict[str, Any]) -> None:
    """Raise unless ``existing`` (same name as ``obj``) is controlled by ``obj``'s owner."""
    want, have = controller_ref(obj), controller_ref(existing)
    if want is None:
        return  # no owner to compare (ppojob render, tests without uids)
    meta = obj["metadata"]
    what = f"{obj['kind']} {meta.get('namespace')}/{meta['name']}"
    if have is not None and have.get("uid") == want.get("uid"):
        return
    if existing.get("metadata", {}).get("deletionTimestamp"):
        raise ChildWaiting(f"{what} is being deleted; waiting to create this job's own")
    if have is None:
        raise ChildConflict(
            f"{what} exists and has no owner, so it is not this PPOJob's and is not adopted. "
            "Delete or rename it; the operator retries"
        )
    if have.get("kind") == want.get("kind") and have.get("name") == want.get("name"):
        raise ChildWaiting(
            f"{what} still belongs to an earlier PPOJob named {want.get('name')} (uid "
            f"{have.get('uid')}) that was deleted; waiting for the garbage collector"
        )
    raise ChildConflict(
        f"{what} exists and is controlled by {have.get('kind')} {have.get('name')} (uid "
        f"{have.get('uid')}), so it is not adopted. Delete or rename it; the operator retries"
    )


def _event(involved: dict[str, Any], type_: str, reason: str, message: str) -> dict[str, Any]:
    meta = involved.get("metadata", {})
    ns = meta.get("namespace") or "default"
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta.get('name', 'ppojob')}.{uuid.uuid4().hex[:16]}",
            "namespace": ns,
        },
        "involvedObject": {
            "apiVersion": involved.get("apiVersion", f"{GROUP}/{VERSION}"),
            "kind": involved.get("kind", KIND),
            "name": meta.get("name"),
            "namespace": ns,
            **({"uid": meta["uid"]} if meta.get("uid") else {}),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1000],
        "source": {"component": "ppojob-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "reportingComponent": "ppojob-operator",
    }
    return event


# ---------------------------------------------------------------------------------------------
# Requests: one aiohttp session per event loop, one configuration and its credentials.
# ---------------------------------------------------------------------------------------------
def _ssl_context(cfg: Any) -> Any:
    import ssl

    if not cfg.verify_ssl:
        return False
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ctx


async def _session() -> Any:
    """This event loop's session, made anew when :func:`configure` ran since."""
    import aiohttp

    loop = asyncio.get_running_loop()
    if _state.config is None:
        configure()
    cfg = _state.config
    made_for, session = _state.sessions.get(loop, (None, None))
    if session is not None and made_for is cfg and not session.closed:
        return session
    if session is not None and not session.closed:
        await session.close()
    conn = aiohttp.TCPConnector(limit=cfg.connection_pool_maxsize, ssl=_ssl_context(cfg))
    session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30))
    with _lock:  # other threads' loops use the dict too
        for other in [lp for lp in _state.sessions if lp.is_closed()]:  # loops gone unclosed
            del _state.sessions[other]
        _state.sessions[loop] = (cfg, session)
    return session


async def aclose() -> None:
    """Close this event loop's session (at operator shutdown)."""
    with _lock:
        _, session = _state.sessions.pop(asyncio.get_running_loop(), (None, None))
    if session is not None and not session.closed:
        await session.close()


AUTH_REFRESH_S = 1.0
"""How long the Authorization header and host are reused before the client's token refresh
hook runs again. The kubeconfig loader's hook re-applies the whole kubeconfig (and rescans the
environment for proxies) on every call, about 1 ms of CPU per request; the tokens it refreshes
are renewed minutes before they expire (in a pod: re-read every minute), so a second of reuse
changes nothing but the cost."""


_clock = time.monotonic


def _auth_and_host() -> tuple[str | None, str]:
    """The Authorization header (None without a token) and the server URL, refreshed at most
    every :data:`AUTH_REFRESH_S` seconds."""
    now = _clock()
    cached = _state.auth
    if cached is not None and now - cached[0] < AUTH_REFRESH_S:
        return cached[1], cached[2]
    cfg = _state.config
    # Recent kubernetes clients key the token as "BearerToken" (the kubeconfig loader does);
    # "authorization" is the older key and ours in configure(host, token=...). This call also
    # runs the loader's token refresh hook.
    token = cfg.get_api_key_with_prefix("BearerToken", alias="authorization")
    _state.auth = (now, token, cfg.host)
    return token, cfg.host


async def arequest(
    method: str, path: str, body: Any = None, content_type: str = "application/json"
) -> dict[str, Any]:
    """One API request; returns the decoded JSON answer, raises :class:`ApiError` on non-2xx.
    Transient failures (429 with its Retry-After, 5xx, a reset connection, a 409 Conflict on a
    patch) are retried a few times within seconds."""
    import aiohttp

    session = await _session()
    headers = {"Accept": "application/json"}
    token, host = _auth_and_host()
    if token:
        headers["Authorization"] = token
    data = None
    if body is not None:
        headers["Content-Type"] = content_type
        data = json.dumps(body, separators=(",", ":"))
    for attempt in range(TRANSIENT_ATTEMPTS):
        last = attempt == TRANSIENT_ATTEMPTS - 1
        try:
            async with session.request(method, host + path, data=data, headers=headers) as resp:
                raw = await resp.read()
                if 200 <= resp.status < 300:
                    return json.loads(raw) if raw else {}
                error = ApiError(resp.status, str(resp.reason), raw.decode("utf-8", "replace"))
                if resp.status == 401:
                    # The next request asks the refresh hook again (with in-cluster config it
                    # re-reads the token file only once its own 60 s cache has expired).
                    _state.auth = None
                wait = _transient_wait(method, resp.status, raw, resp.headers, attempt)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            # reset before or after the server acted: a create is re-sent and answered 409
            # AlreadyExists (acreate_or_get checks the owner), a patch or delete re-applied
            if last:
                raise
            wait = _backoff(attempt)
            log.debug("%s %s: %s; retrying in %.1fs", method, path, exc, wait)
        else:
            if wait is None or last:
                raise error
            log.debug("%s %s: HTTP %s; retrying in %.1fs", method, path, resp.status, wait)
        await asyncio.sleep(wait)
    raise AssertionError("unreachable")


# Transient answers are retried inside the request (a few times, within seconds) instead of
# failing the handler, which kopf would retry only after its 60 s default backoff.
TRANSIENT_ATTEMPTS = 6
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


def _backoff(attempt: int) -> float:
    return min(0.2 * 2**attempt, 5.0)


def _transient_wait(
    method: str, status: int, raw: bytes, headers: Any, attempt: int
) -> float | None:
    """Seconds to wait before re-sending, or None when the answer is final. 429 honours
    Retry-After; a 409 Conflict on a PATCH (ours carry no resourceVersion, so the server gave up
    on its own retries) is retried; a 409 AlreadyExists on a create is an answer, not a fault."""
    if status == 409:
        if method != "PATCH":
            return None
        try:
            reason = json.loads(raw).get("reason")
        except ValueError:
            reason = None
        return _backoff(attempt) if reason == "Conflict" else None
    if status not in TRANSIENT_STATUSES:
        return None
    if status == 429:
        try:
            return min(max(float(headers.get("Retry-After", "")), 0.0), 30.0)
        except ValueError:
            pass
    return _backoff(attempt)


async def aget(api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The object, or None if it does not exist."""
    try:
        return await arequest("GET", path_for(api_version, kind, namespace, name))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def acreate_or_get(
    obj: dict[str, Any], *, recreate_vanished: bool = True
) -> tuple[dict[str, Any], bool]:
    """Create the object; on 409 return the existing one. Returns (object, created).

    Raises :class:`ChildConflict` when the existing object is controlled by another owner. An
    object deleted between the 409 and the read back is created again, or, with
    ``recreate_vanished=False``, raises :class:`ChildVanished` (a RayJob: whoever deleted it,
    the deletion's own reconcile decides whether it may run again).
    """
    meta = obj["metadata"]
    ns, name = meta.get("namespace"), meta["name"]
    collection = path_for(obj["apiVersion"], obj["kind"], ns)
    try:
        return await arequest("POST", collection, obj), True
    except ApiError as exc:
        if exc.status != 409:
            raise ChildRefused(obj, exc) from exc
    existing = await aget(obj["apiVersion"], obj["kind"], ns, name)
    if existing is None:  # deleted between our create and get
        if not recreate_vanished:
            raise ChildVanished(f"{obj['kind']} {ns}/{name} was deleted while being created")
        return await arequest("POST", collection, obj), True
    check_owner(obj, existing)
    return existing, False


async def alist(
    api_version: str, kind: str, namespace: str, label_selector: str | None = None
) -> list[dict[str, Any]] | None:
    """Items of a collection (None when the API is not served: 404)."""
    path = path_for(api_version, kind, namespace)
    if label_selector:
        path += "?labelSelector=" + quote(label_selector)
    try:
        return (await arequest("GET", path)).get("items") or []
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def apatch(
    api_version: str,
    kind: str,
    namespace: str,
    name: str,
    body: dict[str, Any],
    subresource: str | None = None,
) -> dict[str, Any] | None:
    """JSON merge patch; None if the object is gone."""
    try:
        return await arequest(
            "PATCH",
            path_for(api_version, kind, namespace, name, subresource),
            body,
            content_type="application/merge-patch+json",
        )
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def adelete(
    api_version: str, kind: str, namespace: str, name: str, *, uid: str | None = None
) -> bool:
    """Delete an object (background propagation); False if it was already gone.

    With ``uid`` the delete is conditional (``preconditions.uid``): it removes only that
    object, never another one made under the same name since it was read (a restart's next
    attempt). The API server answers 409 Conflict when the name holds another object: raised
    as :class:`Replaced`, which is an answer, not a fault (never retried: :func:`arequest`
    re-sends only a PATCH's 409)."""
    options: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "propagationPolicy": "Background",
    }
    if uid:
        options["preconditions"] = {"uid": uid}
    try:
        await arequest("DELETE", path_for(api_version, kind, namespace, name), options)
    except ApiError as exc:
        if exc.status == 404:
            return False
        if exc.status == 409 and uid:
            raise Replaced(exc.status, exc.reason, exc.body) from exc
        raise
    return True


async def apatch_job_status(
    namespace: str, name: str, status: dict[str, Any]
) -> dict[str, Any] | None:
    """Merge-patch a PPOJob's status subresource; None if the PPOJob is gone."""
    return await apatch(f"{GROUP}/{VERSION}", KIND, namespace, name, {"status": status}, "status")


async def apost_event(involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Post a core/v1 Event about an object; failures are logged, never raised."""
    event = _event(involved, type_, reason, message)
    ns = event["metadata"]["namespace"]
    try:
        await arequest("POST", path_for("v1", "Event", ns), event)
    except Exception as exc:  # events are best-effort
        log.warning(
            "could not post event %s on %s/%s: %s", reason, ns, event["involvedObject"]["name"], exc
        )
