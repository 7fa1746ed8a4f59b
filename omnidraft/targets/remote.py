"""`RemoteTarget`: a target behind a verification server, with the same protocol as LocalTarget.

    target = od.RemoteTarget("http://127.0.0.1:8000", api_key="...")  # default: $OMNIDRAFT_API_KEY
    pair = drafter.pair(target)

The tokenizer comes from the server (or pass `tokenizer=` to use a local copy); its byte-view
fingerprint must match the server's or pairing is refused. One keep-alive HTTP connection is
reused; each call has a timeout; transport failures and 502/503/504 are retried a bounded number
of times, which is safe because a verify request names the committed length it builds on (see
omnidraft/wire.py). A session opens on the server at its first verify: one that only decodes alone is a
single streamed request, as a plain server's completion is, with no session to open or close.
When the server stays unreachable the call raises `TargetUnavailableError`; the pairing keeps
what was committed so far (`error.partial`). Given several replicas' URLs, a session whose replica
stops answering, drains (503) or lost it (a restart: 404) opens again from its committed ids on the
next replica (or the same one) and its verify is sent again: docs/remote.md, "Replicas".
"""

from __future__ import annotations

import logging
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..decode.verify import Verdict
from ..errors import IncompatibleError, RemoteRequestError, StreamCutError, TargetUnavailableError
from ..optional import require
from ..target import Capabilities, SessionBase, TargetBase
from ..translate.codec import ByteCodec
from ..translate.token_bytes import build_token_bytes
from ..wire import (
    ROUTE_HEADER,
    GenerateChunk,
    GenerateRequest,
    InfoReply,
    OpenReply,
    OpenRequest,
    PromptGenerateRequest,
    ServerLoad,
    SparseRow,
    VerifyReply,
    VerifyRequest,
    env_keys,
)
from .remote_http import call_json, refused
from .remote_stream import speculate, stream_ended

__all__ = ["RemoteTarget", "call_json"]

log = logging.getLogger("omnidraft")


class RemoteTarget(TargetBase):
    """A target served by `omnidraft serve` (see server/app.py). Its sessions can hand the rest
    of a completion to the server (`capabilities.decodes_alone`), which a latency-objective pairing
    does when speculating measures slower than the server decoding alone; where the server's engine
    verifies drafts in its own step, a request streams (`capabilities.drafts_in_engine`)."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        api_key: str | None = None,
        tokenizer: Any = None,
        timeout: float = 30.0,
        retries: int = 2,
        client: Any = None,
    ) -> None:
        httpx = require("httpx", "RemoteTarget")
        if retries < 0 or timeout <= 0:
            raise ValueError(f"need retries >= 0 and timeout > 0, got {retries} and {timeout}")
        if api_key is None:  # the variable `omnidraft serve` reads its keys from (the first of them)
            api_key = next(iter(env_keys()), None)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        urls = [url] if isinstance(url, str) else list(url)
        clients = list(client) if isinstance(client, (list, tuple)) else [client] * len(urls)
        if not urls or len(clients) != len(urls):
            raise ValueError("give one URL or a list of replicas' URLs (and as many clients, if any)")
        # (url, client) per replica: every session of this target talks to `url`/`http`, the
        # replica serving now; `fail_over` moves them to the next one
        self.replicas = [
            (u, c if c is not None else httpx.Client(base_url=u, timeout=timeout))
            for u, c in zip(urls, clients)
        ]
        for _, http in self.replicas:
            http.headers.update(headers)
        (self.url, self.http), self.retries = self.replicas[0], retries
        info = InfoReply.model_validate(self._first_answer())
        self.name, self.eos_ids = info.name, frozenset(info.eos_ids)
        self.capabilities = Capabilities(decodes_alone=True, drafts_in_engine=info.drafts_in_engine)
        self.tokenizer = tokenizer if tokenizer is not None else self._fetch_tokenizer()
        self.token_bytes = build_token_bytes(self.tokenizer, info.vocab_size)
        if self.token_bytes.fingerprint != info.fingerprint:
            raise IncompatibleError(
                f"the tokenizer used here ({self.token_bytes.fingerprint}) is not the server's "
                f"({info.fingerprint}) for target {info.name!r}"
            )
        self.codec = ByteCodec(self.tokenizer, self.token_bytes)

    def begin(self, prompt_ids: list[int]) -> _RemoteSession:
        """A session on `prompt_ids`; the server's side opens at its first verify."""
        return _RemoteSession(self, list(prompt_ids))

    def close(self) -> None:
        for _, http in self.replicas:
            http.close()

    def _first_answer(self) -> Any:
        """/v1/info from the first replica that answers (which then serves)."""
        for attempt in range(len(self.replicas)):
            try:
                return self._call("GET", "/v1/info")
            except TargetUnavailableError:
                if attempt == len(self.replicas) - 1 or not self.fail_over(self.http):
                    raise
        raise AssertionError("unreachable")

    def fail_over(self, failed: Any) -> bool:
        """The replica whose client is `failed` did not answer: sessions move to the next replica
        (unless another session moved them already). False where there is no other replica."""
        if len(self.replicas) == 1:
            return False
        if self.http is failed:
            at = next(i for i, (_, http) in enumerate(self.replicas) if http is failed)
            gone, (self.url, self.http) = self.url, self.replicas[(at + 1) % len(self.replicas)]
            log.warning(
                "%s does not answer: sessions continue on %s from their committed tokens", gone, self.url
            )
        return True

    def _fetch_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        files = self._call("GET", "/v1/tokenizer")["files"]
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in files.items():
                (Path(tmp) / Path(name).name).write_text(text, encoding="utf-8")
            return AutoTokenizer.from_pretrained(tmp)

    def _call(self, method: str, path: str, message: Any = None) -> Any:
        content = message.model_dump_json(exclude_none=True) if message is not None else None
        return call_json(self.http, self.url, method, path, content, self.retries)

    def load(self) -> ServerLoad | None:
        """The server's load now, as it advertises it (`/v1/info`: sessions verifying lately, its
        mean engine step, the draft budget a streaming session gets); None from a server that does
        not say."""
        return InfoReply.model_validate(self._call("GET", "/v1/info")).load

    def upload_adapter(self, state: dict[str, Any], requests: int) -> dict[str, int]:
        """Send this device's LoRA adapter (its tensors, as `Pairing.save_adapter` keeps them) and
        how many requests it learned from to the server's adapter exchange (`omnidraft serve
        --share-adapters`, distill/federated.py); no text leaves the device. Returns the shared
        version now and this round's uploads; an adapter the server will not take raises
        RemoteRequestError with its reason."""
        from ..distill.federated import encode_state

        reply = self.http.put(
            "/v1/adapters/upload", params={"requests": requests}, content=encode_state(state)
        )
        if reply.status_code >= 400:
            raise refused(self.url, "/v1/adapters/upload", reply)
        return dict(reply.json())

    def shared_adapter(self) -> tuple[int, dict[str, Any] | None]:
        """The server's shared adapter for this target: (version, its tensors), (0, None) before the
        first round."""
        from ..distill.federated import decode_state

        reply = self.http.get("/v1/adapters/shared")
        if reply.status_code == 404 and "no shared adapter yet" in reply.text:
            return 0, None
        if reply.status_code >= 400:
            raise refused(self.url, "/v1/adapters/shared", reply)
        return int(reply.headers["x-omnidraft-adapter-version"]), decode_state(reply.content)

    def __repr__(self) -> str:
        return f"RemoteTarget({self.name!r} at {self.url})"


class _RemoteSession(SessionBase):
    def __init__(self, owner: RemoteTarget, ids: list[int]) -> None:
        self.owner, self.ids = owner, ids
        self.sid: str | None = None  # the server's session, opened by the first verify
        self.route = secrets.token_hex(8)  # this session's routing key (ROUTE_HEADER)
        self.forwards = 0
        self.budget: int | None = None  # the most draft tokens the server takes next round (its last reply)

    def headers(self) -> dict[str, str]:
        """A request's headers: JSON, and the key a router hashes on to keep a session on one replica."""
        return {"content-type": "application/json", ROUTE_HEADER: self.route}

    def call(self, method: str, path: str, message: Any = None) -> Any:
        content = message.model_dump_json(exclude_none=True) if message is not None else None
        owner = self.owner
        return call_json(
            owner.http, owner.url, method, path, content, owner.retries, {ROUTE_HEADER: self.route}
        )

    def _open(self) -> str:
        if self.sid is None:
            request = OpenRequest(prompt_ids=list(self.ids))
            self.sid = OpenReply.model_validate(self.call("POST", "/v1/sessions", request)).session
        return self.sid

    def verify(
        self,
        proposal: torch.Tensor,
        rule: Any,
        q: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        *,
        topk: int = 0,
    ) -> Verdict:
        ids = [int(t) for t in proposal.tolist()]
        seed = None if rule.mode == "greedy" else int(torch.randint(0, 2**62, (1,), generator=generator))
        rows = None
        if q is not None and rule.mode in ("exact", "omnidraft"):
            rows = [
                SparseRow(ids=nz.tolist(), probs=row[nz].tolist())
                for row in q
                for nz in [row.nonzero().flatten()]
            ]
        request = VerifyRequest(
            committed=len(self.ids),
            proposal=ids,
            mode=rule.mode,
            temperature=rule.temperature,
            q=rows,
            seed=seed,
            topk=topk,
            top_k=rule.top_k,
            top_p=rule.top_p,
            min_p=rule.min_p,
        )
        reply = self._verified(request)
        self.ids += ids[: reply.accepted] + [reply.token]
        self.forwards += 1
        self.budget = reply.budget
        self._check_step(reply.committed)
        top = None
        if reply.topk_ids is not None and reply.topk_logp is not None:
            top = (torch.tensor(reply.topk_ids, dtype=torch.long), torch.tensor(reply.topk_logp))
        return Verdict(reply.accepted, reply.token, top)

    def _verified(self, request: VerifyRequest) -> VerifyReply:
        """The server's verdict on `request`. Where the replica holding the session is gone (it
        stays unreachable, or answers 503 while it drains) or has lost the session (a restart, or
        a router that sent the request to another replica: 404), the session opens again from its
        committed ids, on the next replica or the same URL, and the request, which names that
        committed length, is sent again: committed once."""
        owner = self.owner
        for attempt in range(len(owner.replicas) + 1):
            http = owner.http
            try:
                return VerifyReply.model_validate(
                    self.call("POST", f"/v1/sessions/{self._open()}/verify", request)
                )
            except TargetUnavailableError:
                if attempt == len(owner.replicas) or not owner.fail_over(http):
                    raise
            except RemoteRequestError as exc:
                if exc.status != 404 or self.sid is None or attempt == len(owner.replicas):
                    raise
            log.info("%s: re-opening session %s from %d committed tokens", owner.url, self.sid, len(self.ids))
            self.sid = None  # (opened again on the replica serving now)
        raise AssertionError("unreachable")

    def decode(self, max_tokens: int) -> Iterator[int]:
        """The server greedy-decodes up to `max_tokens` more tokens alone (stopping after an EOS) and
        streams them; each is committed here as it arrives. A stream that breaks starts again from
        the committed ids (`_resumed`). Before the first verify no server session exists and none
        is opened: the request carries the ids."""

        def stream(n: int) -> Iterator[list[int]]:
            message: GenerateRequest | PromptGenerateRequest
            if self.sid is None:
                path, message = "/v1/generate", PromptGenerateRequest(prompt_ids=list(self.ids), max_tokens=n)
            else:
                path, message = (
                    f"/v1/sessions/{self.sid}/generate",
                    GenerateRequest(committed=len(self.ids), max_tokens=n),
                )
            for chunk in self._chunks(path, message):
                yield chunk.tokens

        for tokens in self._resumed(stream, max_tokens):
            yield from tokens

    def steps(
        self,
        max_tokens: int,
        source: Any = None,
        drafter_ids: list[int] | None = None,
        *,
        eos: bool = True,
        rule: Any = None,
    ) -> Iterator[list[int]]:
        """Decode up to `max_tokens` more tokens (stopping after an EOS) in the server's engine
        loop, greedy or sampled under `rule` (a `match` rule), one list of committed ids per chunk;
        with `source` (an `EngineProposals`) the device drafts ahead of the tokens it hears and posts
        proposals, which the engine verifies in its own step (targets/remote_stream.py,
        server/device_proposals.py). Needs a server that `drafts_in_engine`. A stream that breaks
        starts again from the committed ids (`_resumed`)."""
        if not eos:
            raise ValueError("a server stream stops after an EOS; eos=False is not served")
        if source is None and rule is not None and rule.mode != "greedy":
            raise ValueError(
                "a sampled stream without a proposal source is not served by generate (greedy only): "
                "pass source, or sample with pair.generate"
            )
        sampling = {} if rule is None or rule.mode == "greedy" else _sampling_fields(rule)
        first = [drafter_ids]  # the drafter's encoding holds for the first stream only

        def stream(n: int) -> Iterator[list[int]]:
            if source is not None:
                yield from speculate(self, n, source, first.pop() if first else None, sampling)
                return
            path = f"/v1/sessions/{self._open()}/generate"
            for chunk in self._chunks(path, GenerateRequest(committed=len(self.ids), max_tokens=n)):
                yield chunk.tokens

        yield from self._resumed(stream, max_tokens)

    def _resumed(self, stream: Callable[[int], Iterator[list[int]]], max_tokens: int) -> Iterator[list[int]]:
        """`stream(n)`'s lists of committed ids, n the tokens still to come. Where the stream breaks
        or is refused (its replica died, drains: 503, or lost the session: 404) it starts again
        after the ids committed so far, on the next replica or the same URL (where a router sends
        it on), with bounded retries and backoff: each token committed once, the output the
        server's own (docs/deploy.md). A stream the server cut (`StreamCutError`) is not resumed."""
        owner, start = self.owner, len(self.ids)
        attempt = 0
        while True:
            http = owner.http
            try:
                yield from stream(max_tokens - (len(self.ids) - start))
                return
            except (StreamCutError, _OutOfStep):
                raise
            except (TargetUnavailableError, RemoteRequestError) as exc:
                refused_here = isinstance(exc, RemoteRequestError) and exc.status not in (404, 503)
                if refused_here or attempt == owner.retries + len(owner.replicas):
                    raise
                if isinstance(exc, TargetUnavailableError):
                    owner.fail_over(http)
            self.sid = None  # (opened again where the next attempt lands)
            done = len(self.ids) - start >= max_tokens
            if done or (len(self.ids) > start and self.ids[-1] in owner.eos_ids):
                return  # the stream broke after its last token
            log.info("%s: the stream broke after %d tokens; resuming", owner.url, len(self.ids) - start)
            time.sleep(min(2.0, 0.1 * 2**attempt))
            attempt += 1

    def commit(self, chunk: GenerateChunk) -> None:
        """Commit a streamed chunk's tokens, checking the server agrees on the committed length."""
        self.ids += chunk.tokens
        self.forwards += len(chunk.tokens)
        self._check_step(chunk.committed)

    def _check_step(self, committed: int) -> None:
        """The server's committed length after a reply must be this device's."""
        if committed != len(self.ids):
            raise _OutOfStep(
                f"session {self.sid} is out of step: the server has {committed} committed tokens, "
                f"this device {len(self.ids)}"
            )

    def _chunks(self, path: str, message: Any) -> Iterator[GenerateChunk]:
        """The chunks of one NDJSON stream, each committed here as it arrives."""
        import httpx

        owner = self.owner
        content = message.model_dump_json()
        try:
            with owner.http.stream("POST", path, content=content, headers=self.headers()) as reply:
                if reply.status_code >= 400:
                    reply.read()
                    raise refused(owner.url, path, reply)
                for line in reply.iter_lines():
                    if not line.strip():
                        continue
                    chunk = GenerateChunk.model_validate_json(line)
                    self.commit(chunk)
                    yield chunk
                    if chunk.done:
                        stream_ended(chunk)
                        return
        except httpx.TransportError as exc:
            raise TargetUnavailableError(
                f"{owner.url}{path}: the stream broke ({type(exc).__name__}: {exc})"
            ) from exc

    def close(self) -> None:
        """Free the server's KV cache for this session now (it would expire anyway); nothing to do
        for a session that never verified (the server kept none)."""
        if self.sid is None:
            return
        try:
            self.call("DELETE", f"/v1/sessions/{self.sid}")
        except (TargetUnavailableError, RemoteRequestError):
            pass  # the server is gone or already dropped it: nothing left to free
        self.sid = None


class _OutOfStep(TargetUnavailableError):
    """The server's committed length is not this device's: what was committed here cannot be
    trusted to continue from, so the request ends (never resumed)."""


def _sampling_fields(rule: Any) -> dict[str, Any]:
    """A sampled rule's fields as a request carries them (wire._Sampled)."""
    return {
        "temperature": rule.temperature,
        "top_k": rule.top_k,
        "top_p": rule.top_p,
        "min_p": rule.min_p,
        "seed": rule.seed,
    }
