"""How a harness tells the gateway who is calling: the session URL and the headers.

Everything the gateway learns about a call's place in the session tree comes from here,
so that the wire format can be adjusted in one file:
- the session, and for a subagent the call that spawned it, travel in the base URL
  (`session_base_url`), so any OpenAI-API harness that can set a base URL per session
  is recorded correctly;
- the role (main, main_summary, subagent, subagent_summary), the task id and the link of
  a post-compaction call to its summary call travel as headers (`request_headers`).
- the id of a recorded call is the response's `id` (`call_id_of`).

The API key: in `tidal run` each episode gets its own secret, and the gateway accepts
it only for that episode's sessions (`tidal.gateway.access`); a gateway that requires no
key (`tidal serve` by default) is sent the placeholder `API_KEY_PLACEHOLDER`.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass

import openai
from openai import OpenAI
from openai.types.chat import ChatCompletion

API_KEY_PLACEHOLDER = "tidal"
ROLE_HEADER = "X-Tidal-Role"
TASK_HEADER = "X-Tidal-Task"
PARENT_CALL_HEADER = "X-Tidal-Parent-Call"


@dataclass(frozen=True)
class SpawnLink:
    """A subagent session's link to the call (in its parent session) that spawned it."""

    parent_session_id: str
    parent_call_id: str


def new_session_id(prefix: str = "s") -> str:
    """A fresh session id accepted by the ledger (letters, digits, '-')."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def session_base_url(
    gateway_url: str, session_id: str, spawn: SpawnLink | None = None, *,
    task_id: str | None = None,
) -> str:
    """The OpenAI base URL of one session, e.g. http://127.0.0.1:8000/sessions/s-1/v1.

    A subagent's URL also names its spawning call and that call's session, as the
    gateway's (name, value) path parts (docs/gateway.md):
    `.../sessions/{sub_id}/parent/{parent_call_id}/parent-session/{parent_session_id}/v1`.
    With `task_id` the URL names the task too (`.../sessions/{id}/task/{task}/v1`), so a
    harness that sends no tidal header is still grouped by task.
    """
    root = gateway_url.rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"gateway_url must be an http(s) URL, got {gateway_url!r}")
    parts = {"session_id": session_id}
    if spawn is not None:
        parts["parent_session_id"] = spawn.parent_session_id
        parts["parent_call_id"] = spawn.parent_call_id
    if task_id is not None:
        parts["task_id"] = task_id
    for name, value in parts.items():
        if not value or any(c in value for c in "/?#% "):
            raise ValueError(f"{name} must be non-empty and URL-path safe, got {value!r}")
    url = f"{root}/sessions/{session_id}"
    if spawn is not None:
        url += f"/parent/{spawn.parent_call_id}/parent-session/{spawn.parent_session_id}"
    if task_id is not None:
        url += f"/task/{task_id}"
    return url + "/v1"


def request_headers(
    role: str, task_id: str | None = None, parent_call_id: str | None = None
) -> dict[str, str]:
    """Per-request headers: the role, the task, and the summary call a fresh context follows."""
    headers = {ROLE_HEADER: role}
    if task_id is not None:
        headers[TASK_HEADER] = task_id
    if parent_call_id is not None:
        headers[PARENT_CALL_HEADER] = parent_call_id
    return headers


def call_id_of(response: ChatCompletion) -> str:
    """The gateway's id for the recorded call behind a response: the gateway answers
    with `id = "chatcmpl-" + call id` (docs/gateway.md)."""
    return response.id.removeprefix("chatcmpl-")


@functools.cache
def _shared_http() -> openai.DefaultHttpxClient:
    """One HTTP connection pool for every session of the process: a client of its own
    per session costs ~25-50 ms of CPU (an SSL context it never uses on the loopback
    gateway) and keeps its connections open once the session is over."""
    return openai.DefaultHttpxClient()


def default_client_factory(base_url: str, api_key: str, timeout_s: float) -> OpenAI:
    """The stock openai client for one session; no retries (a retry would be a new call).
    Its requests go through the process's one connection pool, each with `timeout_s`."""
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                  timeout=timeout_s, http_client=_shared_http())
