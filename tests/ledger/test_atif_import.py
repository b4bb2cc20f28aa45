"""`tidal ledger import --atif DIR`: ATIF trajectories with token ids into the ledger.

tidal's own export comes back exactly (export -> import -> export gives the same files,
and the same calls); another producer's trajectory imports what it carries; bad input is
refused naming the file, the step and what is wrong, and leaves the store as it was."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from tests.gateway.scripted_engine import ScriptedEngine
from tests.gateway.test_http_drift import TOOLS, USER, tag_call
from tidal.cli import app
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.gateway.verify import verify_store
from tidal.ledger import Call, LedgerError, LedgerStore
from tidal.ledger.atif import write_atif
from tidal.ledger.atif_import import append_atif, atif_records, read_atif
from tidal.ledger.types import call_to_dict, outcome_to_dict

from .helpers import fill, fingerprint, growing_session
from .test_atif import HARBOR_PYTHON, _validate_with_harbor, episode

Doc = dict[str, Any]
Mutation = Callable[[dict[str, Doc]], object]


def gateway_like(calls: list[Call]) -> list[Call]:
    """The calls with the gateway's `metadata.turn`: the content the client was shown
    (none beside a tool call), which is what the assistant message it sends back holds."""
    return [replace(c, metadata={"turn": {"position": len(c.messages or ()),
                                          "content": None}}) for c in calls]


def full_ledger(path: Path) -> None:
    """Every kind of session the export handles: tool calls, a subagent, a compaction
    (`episode`), calls without messages, task ids, sampling, metadata, tool calls in
    another form than ATIF's (`fill`)."""
    with LedgerStore(path) as store:
        episode(store, gateway_like)
        store.append_calls(growing_session("old", 2))
        fill(store)


def records(path: Path) -> tuple[dict[tuple[str, str], dict[str, Any]], list[dict[str, Any]]]:
    with LedgerStore(path, readonly=True) as store:
        calls = {(c.session_id, c.call_id): call_to_dict(c) for c in store.iter_full_calls()}
        outcomes = [outcome_to_dict(o) for o in store.outcomes().values()]
    return calls, outcomes


def read_dir(d: Path) -> dict[str, Doc]:
    return {p.name: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))}


def write_dir(d: Path, docs: dict[str, Doc]) -> Path:
    d.mkdir(exist_ok=True)
    for name, doc in docs.items():
        (d / name).write_text(json.dumps(doc))
    return d


def test_export_import_export_gives_the_same_files_and_calls(tmp_path: Path) -> None:
    full_ledger(tmp_path / "a.db")
    with LedgerStore(tmp_path / "a.db") as store:
        assert verify_store(store).ok
        write_atif(store, tmp_path / "one")
    got = read_atif(tmp_path / "one")
    assert got.episodes == 3 and got.notes == []
    assert set(got.sessions) == {"ep", "ep-sub", "old", "main-1", "sub-1"}
    with LedgerStore(tmp_path / "b.db") as store:
        rep = append_atif(got, store)
        assert (rep.calls, rep.outcomes) == (14, 4)
        assert store.check() == []
        assert verify_store(store).ok
        write_atif(store, tmp_path / "two")
    first, second = read_dir(tmp_path / "one"), read_dir(tmp_path / "two")
    assert list(first) == ["ep.cont-1.json", "ep.json", "main-1.json", "old.json"]
    assert first == second
    # the ledger itself: every call and outcome as it was, messages included (the
    # assistant turns rebuilt from the steps as the gateway shows them to the client);
    # the tools that changed mid-session, tool calls in another form than ATIF's, calls
    # without messages: each from what the steps' `extra` adds
    calls_a, outcomes_a = records(tmp_path / "a.db")
    calls_b, outcomes_b = records(tmp_path / "b.db")
    assert calls_a.keys() == calls_b.keys()
    for key, a in calls_a.items():
        assert calls_b[key] == a, key
    assert outcomes_b == outcomes_a
    with LedgerStore(tmp_path / "b.db") as store:
        infos = {i.session_id: i for i in store.sessions()}
    assert (infos["ep-sub"].parent_session_id, infos["ep-sub"].parent_call_id) == ("ep", "c2")
    assert infos["main-1"].task_id == "task-1"


def test_a_gateway_ledger_comes_back_exactly_but_for_messages(tmp_path: Path) -> None:
    """Through the real gateway (scripted engine, real tokenizer): tool calls whose
    arguments the client re-spaced (drift records in metadata), and a subagent."""
    tools: Any = TOOLS
    tokenizer = load_tokenizer(ensure_tiny())
    engine = ScriptedEngine(tokenizer)
    with LedgerStore(tmp_path / "a.db") as store:
        server = GatewayServer(engine, tokenizer, store, port=0)
        server.start()
        try:
            def client(sid: str, **kw: Any) -> openai.OpenAI:
                return openai.OpenAI(base_url=server.session_url(sid, **kw), api_key="x",
                                     max_retries=0, timeout=60)

            engine.push(tag_call("set_switch", '{"name":"beta","on":true}'))
            first: list[Any] = [USER]
            r = client("main").chat.completions.create(model="scripted", messages=first,
                                                       tools=tools)
            parent = r.tidal["call_id"]  # type: ignore[attr-defined]
            msg = r.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})
            msg["tool_calls"][0]["function"]["arguments"] = '{"name": "beta", "on": true}'
            engine.push("Done.")
            client("sub", parent_call=parent).chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "help"}])
            engine.push("All done.")
            history: list[Any] = [USER, msg, {"role": "tool", "content": "ok",
                                              "tool_call_id": msg["tool_calls"][0]["id"]}]
            client("main").chat.completions.create(model="scripted", tools=tools,
                                                   messages=history)
        finally:
            server.stop()
        assert verify_store(store).ok
        write_atif(store, tmp_path / "one")
    with LedgerStore(tmp_path / "b.db") as store:
        append_atif(read_atif(tmp_path / "one"), store)
        assert store.check() == [] and verify_store(store).ok
        write_atif(store, tmp_path / "two")
    assert read_dir(tmp_path / "one") == read_dir(tmp_path / "two")
    calls_a, _ = records(tmp_path / "a.db")
    calls_b, _ = records(tmp_path / "b.db")
    assert calls_a.keys() == calls_b.keys() and len(calls_a) == 3
    for key, a in calls_a.items():
        b = calls_b[key]
        assert {k: v for k, v in b.items() if k != "messages"} == \
            {k: v for k, v in a.items() if k != "messages"}, key
    assert calls_a[("main", parent)]["metadata"]["turn"]  # the gateway's, carried whole


# ------------------------------------------------------------ another producer's ATIF


def _agent_step(step_id: int, message: str, prompt: list[int], completion: list[int],
                **more: Any) -> Doc:
    return {"step_id": step_id, "source": "agent", "message": message,
            "metrics": {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                        "prompt_token_ids": prompt, "completion_token_ids": completion,
                        "logprobs": [-0.5] * len(completion)}, **more}


def third_party() -> dict[str, Doc]:
    """A terminus-2-like run: a root, its continuation after a compaction, an embedded
    helper (sharing the run's session id, as ATIF allows) and a summary subagent in a
    file of its own (`trajectory_path`). `extra` is the producer's own."""
    agent = {"name": "terminus-2", "version": "2.0", "model_name": "m",
             "tool_definitions": [{"type": "function", "function": {"name": "bash"}}]}
    helper = {"schema_version": "ATIF-v1.7", "session_id": "run-1", "trajectory_id": "helper",
              "agent": agent, "steps": [
                  {"step_id": 1, "source": "user", "message": "Which files?"},
                  _agent_step(2, "a and b", [20, 21], [22, 23])]}
    root = {
        "schema_version": "ATIF-v1.7", "session_id": "run-1", "agent": agent,
        "steps": [
            {"step_id": 1, "source": "system", "message": "You are an agent."},
            {"step_id": 2, "source": "user", "message": "Count the files."},
            _agent_step(3, "Listing.", [1, 2, 3, 4, 5], [6, 7, 8],
                        timestamp="2025-01-01T00:00:01Z", reasoning_content="think",
                        tool_calls=[{"tool_call_id": "call_a", "function_name": "bash",
                                     "arguments": {"cmd": "ls"}}],
                        observation={"results": [{"source_call_id": "call_a",
                                                  "content": "a\nb\n"}]},
                        extra={"call_id": "chatcmpl-1", "policy_version": "gpt-x"}),
            _agent_step(4, "Asking a helper.", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10],
                        observation={"results": [{"subagent_trajectory_ref": [
                            {"trajectory_id": "helper", "session_id": "run-1"}]}]}),
            {"step_id": 5, "source": "system", "message": "Summarized.",
             "observation": {"results": [{"subagent_trajectory_ref": [
                 {"session_id": "run-1-summary",
                  "trajectory_path": "trajectory.summary.json"}]}]}},
        ],
        "continued_trajectory_ref": "trajectory.cont-1.json",
        "subagent_trajectories": [helper],
    }
    cont = {
        "schema_version": "ATIF-v1.7", "session_id": "run-1", "agent": agent, "steps": [
            {"step_id": 1, "source": "system", "message": "You are an agent.",
             "is_copied_context": True},
            _agent_step(2, "Listing.", [1, 2, 3, 4, 5], [6, 7, 8], is_copied_context=True),
            {"step_id": 3, "source": "user", "message": "Summary: 2 files. Go on."},
            _agent_step(4, "There are 2.", [1, 30, 31], [32, 33])]}
    summary = {
        "schema_version": "ATIF-v1.7", "session_id": "run-1-summary", "agent": agent, "steps": [
            {"step_id": 1, "source": "user", "message": "Summarize."},
            _agent_step(2, "2 files.", [40, 41], [42])]}
    return {"trajectory.json": root, "trajectory.cont-1.json": cont,
            "trajectory.summary.json": summary}


def test_another_producers_trajectories_import_what_they_carry(tmp_path: Path) -> None:
    got = atif_records(third_party(), directory=tmp_path)
    assert got.episodes == 1
    assert list(got.sessions) == ["run-1", "run-1.helper", "run-1-summary"]
    calls = {(c.session_id, c.call_id): c for c in got.calls}
    assert list(calls) == [("run-1", "step-3"), ("run-1", "step-4"),
                           ("run-1", "cont-1.step-4"),  # the copied step 2 is no call
                           ("run-1.helper", "step-2"), ("run-1-summary", "step-2")]
    first = calls[("run-1", "step-3")]
    assert first.prompt_ids.tolist() == [1, 2, 3, 4, 5]
    assert first.output_ids.tolist() == [6, 7, 8]
    assert first.output_logprobs.tolist() == [-0.5] * 3
    assert (first.role, first.policy_version, first.finish_reason) == ("main", 0, "unknown")
    assert first.started_at == first.ended_at == 1735689601.0
    assert first.tool_calls == [{"id": "call_a", "name": "bash", "arguments": '{"cmd": "ls"}'}]
    assert first.metadata == {"atif": {"file": "trajectory.json", "trajectory_id": None,
                                       "step_id": 3}}
    assert first.messages == [{"role": "system", "content": "You are an agent."},
                              {"role": "user", "content": "Count the files."}]
    assert first.tools == [{"type": "function", "function": {"name": "bash"}}]
    assert calls[("run-1", "step-4")].messages == [*first.messages, {
        "role": "assistant", "content": "Listing.", "tool_calls": [{
            "id": "call_a", "type": "function",
            "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "a\nb\n"}]
    assert [m["content"] for m in calls[("run-1", "cont-1.step-4")].messages or ()] == [
        "You are an agent.", "Listing.", "Summary: 2 files. Go on."]
    helper = calls[("run-1.helper", "step-2")]
    assert (helper.role, helper.parent_session_id, helper.parent_call_id) == (
        "subagent", "run-1", "step-4")
    summary = calls[("run-1-summary", "step-2")]  # referred to by a system step: no call
    assert (summary.parent_session_id, summary.parent_call_id) == ("run-1", None)
    assert got.outcomes == []
    with LedgerStore(tmp_path / "l.db") as store:
        append_atif(got, store)
        assert store.check() == [] and verify_store(store).ok
        assert [c.session_id for c in store.sessions()] == list(got.sessions)
        assert store.episode_sessions("run-1") == ["run-1", "run-1.helper", "run-1-summary"]


@pytest.mark.skipif(not HARBOR_PYTHON.exists(),
                    reason=".venv-harbor does not exist: run .ci/harbor-venv.sh")
def test_the_third_party_fixture_and_its_export_are_valid_atif(tmp_path: Path) -> None:
    d = write_dir(tmp_path / "tp", third_party())
    with LedgerStore(tmp_path / "l.db") as store:
        append_atif(read_atif(d), store)
        write_atif(store, tmp_path / "out")
    files = [*sorted(d.glob("*.json")), *sorted((tmp_path / "out").glob("*.json"))]
    assert len(files) == 3 + 2  # the export: run-1 and its continuation, subagents embedded
    checked = _validate_with_harbor(files)
    assert checked.returncode == 0, checked.stderr[-3000:]


# ------------------------------------------------------------------------ bad input


def _step(docs: dict[str, Doc], n: int) -> Doc:
    step: Doc = docs["trajectory.json"]["steps"][n - 1]
    return step


def _without(key: str) -> Mutation:
    def cut(docs: dict[str, Doc]) -> None:
        del _step(docs, 3)["metrics"][key]
    return cut


def _set(n: int, path: tuple[str | int, ...], value: Any) -> Mutation:
    def put(docs: dict[str, Doc]) -> None:
        target: Any = _step(docs, n)
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = value
    return put


BAD: list[tuple[str, Mutation, str]] = [
    ("no token ids", _without("completion_token_ids"),
     "trajectory.json step 3: its metrics hold no prompt_token_ids and completion_token_ids"),
    ("no logprobs", _without("logprobs"), "trajectory.json step 3: its metrics hold no logprobs"),
    ("no metrics", lambda d: _step(d, 4).pop("metrics"), "trajectory.json step 4: its metrics"),
    ("step ids out of order", _set(3, ("step_id",), 7),
     "trajectory.json steps[2]: step_id must be 3"),
    ("logprobs short", _set(3, ("metrics", "logprobs"), [-0.1, -0.2]),
     "trajectory.json step 3: metrics.logprobs has 2 entries but "
     "metrics.completion_token_ids has 3 tokens"),
    ("negative token id", _set(3, ("metrics", "prompt_token_ids"), [1, -2]),
     "trajectory.json step 3: metrics.prompt_token_ids[1] is negative"),
    ("text token id", _set(3, ("metrics", "completion_token_ids"), [6, "7", 8]),
     "trajectory.json step 3: metrics.completion_token_ids[1] must be an integer token id"),
    ("positive logprob", _set(3, ("metrics", "logprobs"), [-0.1, 0.5, -0.1]),
     "trajectory.json step 3: call 'step-3' of session 'run-1': output_logprobs[1] = 0.5"),
    ("unknown field", _set(3, ("metric",), {}), "unknown field(s) 'metric'"),
    ("bad source", _set(2, ("source",), "human"),
     "trajectory.json step 2: source must be \"system\", \"user\" or \"agent\""),
    ("bad timestamp", _set(3, ("timestamp",), "yesterday"),
     "trajectory.json step 3: timestamp 'yesterday' is not an ISO 8601 time"),
    ("result of no call", _set(3, ("observation", "results", 0, "source_call_id"), "x"),
     "trajectory.json step 3: an observation result's source_call_id 'x' is not one of"),
    ("message missing", lambda d: _step(d, 2).pop("message"),
     "trajectory.json step 2: missing required field message"),
    ("continuation missing", lambda d: d.pop("trajectory.cont-1.json"),
     "continued_trajectory_ref 'trajectory.cont-1.json' names no trajectory file"),
    ("subagent missing", lambda d: d.pop("trajectory.summary.json"),
     "trajectory.json step 5: subagent_trajectory_ref 'trajectory.summary.json' names no"),
    ("bad session id", lambda d: d["trajectory.json"].update(session_id="run 1"),
     "trajectory.json: session_id must be a string of 1-128 characters"),
    ("one session twice", lambda d: d.update({"other.json": {
        **d["trajectory.summary.json"], "session_id": "run-1"}}),
     "trajectory.json: session 'run-1' is also "),
    ("a cycle", lambda d: d["trajectory.summary.json"].update(
        continued_trajectory_ref="trajectory.json"),
     "that no root trajectory leads to (the references go round in a cycle)"),
    ("named twice", lambda d: d["trajectory.summary.json"].update(
        continued_trajectory_ref="trajectory.cont-1.json"),
     "continued_trajectory_ref 'trajectory.cont-1.json' names a file that"),
]


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A store that already holds a session: what a refused import must leave alone."""
    path = tmp_path / "target.db"
    with LedgerStore(path) as store:
        store.append_calls(growing_session("kept", 3))
    return path


def ledger(*args: str) -> Any:
    return CliRunner().invoke(app, ["ledger", *args])


@pytest.mark.parametrize(("case", "mutate", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_naming_the_file_and_step_and_changes_nothing(
        tmp_path: Path, target: Path, case: str, mutate: Mutation,
        message: str) -> None:
    docs = copy.deepcopy(third_party())
    mutate(docs)
    d = write_dir(tmp_path / "in", docs)
    before = fingerprint(target)
    r = ledger("import", "--atif", str(d), "--store", str(target))
    assert r.exit_code == 2, r.output
    assert message in r.output, r.output
    assert r.output.startswith("error: ") and "Traceback" not in r.output
    assert fingerprint(target) == before
    # and into a new store: none is left behind
    r = ledger("import", "--atif", str(d), "--store", str(tmp_path / "new" / "l.db"))
    assert r.exit_code == 2 and not (tmp_path / "new").exists()


def test_skip_untrainable_imports_the_rest_noting_each_step(tmp_path: Path) -> None:
    docs = third_party()
    del _step(docs, 3)["metrics"]
    del docs["trajectory.summary.json"]["steps"][1]["metrics"]["logprobs"]
    with pytest.raises(LedgerError, match="--skip-untrainable"):
        atif_records(docs)
    got = atif_records(docs, skip_untrainable=True)
    assert [(c.session_id, c.call_id) for c in got.calls] == [
        ("run-1", "step-4"), ("run-1", "cont-1.step-4"), ("run-1.helper", "step-2")]
    assert got.notes == [
        "skipped trajectory.json step 3: its metrics hold no prompt_token_ids and "
        "completion_token_ids, so it cannot be trained",
        "skipped trajectory.summary.json step 2: its metrics hold no logprobs, so it cannot "
        "be trained",
        "skipped trajectory.summary.json: session 'run-1-summary' has no agent step with "
        "token ids"]
    # the skipped step is still a turn of the conversation the next call saw
    step4 = got.calls[0]
    assert [m["role"] for m in step4.messages or ()] == ["system", "user", "assistant", "tool"]


def test_sessions_already_in_the_ledger_are_refused_by_name(tmp_path: Path) -> None:
    d = write_dir(tmp_path / "in", third_party())
    store = tmp_path / "l.db"
    assert ledger("import", "--atif", str(d), "--store", str(store)).exit_code == 0
    before = fingerprint(store)
    r = ledger("import", "--atif", str(d), "--store", str(store))
    assert r.exit_code == 2
    assert "session(s) 'run-1' (" in r.output and "'run-1-summary'" in r.output
    assert "already in" in r.output and "nothing was imported" in r.output
    assert fingerprint(store) == before


def test_a_refusal_inside_the_transaction_writes_nothing(tmp_path: Path, target: Path) -> None:
    """A link the store refuses (a parent call that does not exist) after earlier calls
    of the import were inserted: the whole import rolls back."""
    full_ledger(tmp_path / "a.db")
    with LedgerStore(tmp_path / "a.db") as store:
        write_atif(store, tmp_path / "out")
    doc = json.loads((tmp_path / "out" / "ep.json").read_text())
    doc["subagent_trajectories"][0]["steps"][-1]["extra"]["parent_call_id"] = "c-nope"
    (tmp_path / "out" / "ep.json").write_text(json.dumps(doc))
    before = fingerprint(target)
    r = ledger("import", "--atif", str(tmp_path / "out"), "--store", str(target))
    assert r.exit_code == 2
    assert "parent call 'c-nope' of session 'ep' is not in the ledger" in r.output
    assert "nothing was imported" in r.output
    assert fingerprint(target) == before


def test_unreadable_input(tmp_path: Path, target: Path) -> None:
    d = write_dir(tmp_path / "in", third_party())
    (d / "trajectory.cont-1.json").write_text('{"steps": [NaN]}')
    assert "trajectory.cont-1.json: not valid JSON (NaN is not a JSON number)" in ledger(
        "import", "--atif", str(d), "--store", str(target)).output
    (d / "trajectory.cont-1.json").write_bytes(b'{"a": "\x95"}')
    assert "trajectory.cont-1.json: not UTF-8 text" in ledger(
        "import", "--atif", str(d), "--store", str(target)).output
    (d / "trajectory.cont-1.json").write_text('{"a": "\\ud800"}')
    assert "holds a lone surrogate" in ledger(
        "import", "--atif", str(d), "--store", str(target)).output
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no ATIF trajectory (*.json file)" in ledger(
        "import", "--atif", str(empty), "--store", str(target)).output
    assert "it is a file; give the directory" in ledger(
        "import", "--atif", str(d / "trajectory.json"), "--store", str(target)).output
    assert "give a JSONL FILE or --atif DIR (one of them)" in ledger(
        "import", "--store", str(target)).output


def test_the_cli_end_to_end(tmp_path: Path) -> None:
    full_ledger(tmp_path / "a.db")
    r = ledger("export", str(tmp_path / "a.db"), "--atif", str(tmp_path / "atif"))
    assert r.exit_code == 0, r.output
    r = ledger("import", "--atif", str(tmp_path / "atif"), "--store",
               str(tmp_path / "runs" / "b.db"))
    assert r.exit_code == 0, r.output
    assert "imported 14 calls and 4 outcomes (3 episodes) into" in r.output
    assert ledger("check", str(tmp_path / "runs" / "b.db")).exit_code == 0
    r = CliRunner().invoke(app, ["verify", str(tmp_path / "runs" / "b.db")])
    assert r.exit_code == 0 and ": ok" in r.output, r.output
    r = ledger("export", str(tmp_path / "runs" / "b.db"), "--atif", str(tmp_path / "again"))
    assert r.exit_code == 0
    assert read_dir(tmp_path / "atif") == read_dir(tmp_path / "again")
    # a third party's, with a step to skip
    docs = third_party()
    del _step(docs, 3)["metrics"]
    d = write_dir(tmp_path / "tp", docs)
    r = ledger("import", "--atif", str(d), "--store", str(tmp_path / "runs" / "b.db"),
               "--skip-untrainable")
    assert r.exit_code == 0, r.output
    assert "note: skipped" in r.output and "trajectory.json step 3" in r.output
    assert "imported 4 calls and 0 outcomes (1 episode)" in r.output
